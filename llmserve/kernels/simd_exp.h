// e^x of 16 floats (8 on AVX2), for the kernels that need it: attention's softmax (paged_attention.cpp) and SiLU
// (fused_elementwise.cpp). A header, not a copy in each: kernels/__init__.py folds its text into the
// build flags, so an edit here rebuilds the library like an edit of a source does.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace llmserve {

// Cephes' expf: range reduction by ln 2 (in two parts, high and low), a degree-6 polynomial, then the power of two;
// ~1 ulp. Below -87.3 the result is ~0 (where float's range ends); callers keep x below 88 (e^88 overflows). Both
// widths below take their constants from here.
struct ExpConstants {
  static constexpr float kMin = -87.3f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
  static constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

#if defined(__AVX512F__)
// e^x of 16 floats, the power of two applied by scalef
inline __m512 exp16(__m512 x) {
  using C = ExpConstants;
  x = _mm512_max_ps(x, _mm512_set1_ps(C::kMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(C::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2Low), r);
  __m512 p = _mm512_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::kPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// e^x of 8 floats (the AVX2 attention kernels' softmax): the power of two goes into the exponent's bits (n >= -126
// after the clamp, so 2^n is a normal float)
inline __m256 exp8(__m256 x) {
  using C = ExpConstants;
  x = _mm256_max_ps(x, _mm256_set1_ps(C::kMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(C::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C::kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C::kLn2Low), r);
  __m256 p = _mm256_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::kPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
#endif  // AVX2 and FMA

}  // namespace llmserve
