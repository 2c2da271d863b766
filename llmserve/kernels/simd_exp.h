// e^x of 16 floats, for the kernels that need it: attention's softmax (paged_attention.cpp) and SiLU
// (fused_elementwise.cpp). A header, not a copy in each: kernels/__init__.py folds its text into the
// build flags, so an edit here rebuilds the library like an edit of a source does.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace llmserve {

// Cephes' expf: range reduction by ln 2, degree-6 polynomial, the power of two applied by scalef; ~1 ulp.
// Below -87.3 the result is ~0 (where float's range ends); callers keep x below 88 (e^88 overflows).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace llmserve
#endif
