// The decoder layer's elementwise rows (RMSNorm with or without the residual add, rotary, the SwiGLU gate, an int8
// product's row scales) as templates on raw pointers: the ops of fused_elementwise.cpp (eager steps) and the fused
// decode stack (decode_layer.cpp, which calls them in place on its own buffers, without a dispatch or an
// allocation) share them, so both compute the same bits. kernels/__init__.py folds a header's text into the build
// flags.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_exp.h"
#include "team.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

// Each row function is compiled once for the library, never inlined or cloned for a caller's constants:
// specialised into its caller under -ffast-math a body may be reassociated there (a division by the row length
// turned into a multiplication by a reciprocal hoisted out of the row loop, products regrouped), so the eager op
// and the fused decode stack could round one row differently (a SmolLM2 batch-33 step: one row's RMSNorm a last
// bit apart). A template's out-of-line instances in every object file are one function after linking.
// RMSNorm also keeps IEEE arithmetic (LLMSERVE_EXACT_MATH): its 1/sqrt exact rather than an estimate, which
// decided a near tie against float32 (tests/engine/test_correctness.py); once a row, so it costs nothing.
// LLMSERVE_IEEE_LOOPS: loops whose float32 results must be PyTorch's bit for bit (grid_levels.cpp, ggml_decode.cpp):
// no reciprocal divisions, no contracted multiply-adds, while nearbyint and the clamps still vectorize (traps and
// errno off change no result). Helpers they call carry it too: GCC does not inline across optimize attributes.
#if defined(__clang__)
#define LLMSERVE_ONE_BODY __attribute__((noinline))
#define LLMSERVE_EXACT_MATH
#define LLMSERVE_IEEE_LOOPS
#else
#define LLMSERVE_ONE_BODY __attribute__((noipa))
#define LLMSERVE_EXACT_MATH __attribute__((optimize("no-fast-math")))
#define LLMSERVE_IEEE_LOOPS \
  __attribute__((optimize("no-fast-math", "fp-contract=off", "no-trapping-math", "no-math-errno")))
#endif

namespace llmserve {
namespace elementwise {

// rows per parallel chunk: ~16K elements, so a step of a few tokens stays on one thread
inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {  // bf16 is the top half of a float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  // round to nearest even, as c10::BFloat16(float) does; NaN stays a quiet NaN
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

using llmserve::exp16;  // simd_exp.h

// x / (1 + e^-z) (SiLU: z = x; GELU's tanh form: z = 2u, `GeluTanh`), the division as a reciprocal estimate and one Newton step
// (~1 ulp): a 512-bit division has 16-cycle throughput, which bound the whole gate
inline __m512 over_one_plus_exp_neg(__m512 x, __m512 z) {
  const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), _mm512_set1_ps(88.f));  // no inf
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(x, inv);
}
#endif

// One row of RMSNorm: out = w * x * rsqrt(mean(x^2) + eps), with (1 + w) in float32 for `unit_offset` (Gemma's
// norms: the scale stored less one); `sum_out`, when given, receives x itself (the residual stream), x being `a + b`
// when `b` is given.
template <typename T, typename W>
LLMSERVE_ONE_BODY LLMSERVE_EXACT_MATH void rms_norm_row(const T* a, const T* b, const W* w, T* out, T* sum_out,
                                                        int64_t n, float eps, bool unit_offset = false) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    __m512 x = load16(a + i, m);
    if (b != nullptr) {
      x = _mm512_add_ps(x, load16(b + i, m));
      store16(sum_out + i, x, m);
      x = load16(sum_out + i, m);  // normalise the rounded sum: the residual stream the next layer sees
    }
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps));
  const T* src = b != nullptr ? sum_out : a;
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 scale = unit_offset ? _mm512_add_ps(load16(w + i, m), one) : load16(w + i, m);
    store16(out + i, _mm512_mul_ps(scale, _mm512_mul_ps(load16(src + i, m), r)), m);
  }
#else
  // eight running sums (one vector's lanes on AVX2): without fast-math one sum would be a serial chain
  constexpr int64_t kSums = 8;
  float sums[kSums] = {};
  auto square = [&](int64_t i) {
    float x = static_cast<float>(a[i]);
    if (b != nullptr) {
      sum_out[i] = static_cast<T>(x + static_cast<float>(b[i]));
      x = static_cast<float>(sum_out[i]);
    }
    return x * x;
  };
  int64_t j = 0;
  for (; j + kSums <= n; j += kSums)
    for (int64_t k = 0; k < kSums; ++k) sums[k] += square(j + k);
  for (; j < n; ++j) sums[j % kSums] += square(j);
  float acc = 0.f;
  for (float sum : sums) acc += sum;
  const float r = 1.f / std::sqrt(acc / static_cast<float>(n) + eps);
  const T* src = b != nullptr ? sum_out : a;
  for (int64_t i = 0; i < n; ++i) {
    const float scale = unit_offset ? static_cast<float>(w[i]) + 1.f : static_cast<float>(w[i]);
    out[i] = static_cast<T>(scale * (static_cast<float>(src[i]) * r));
  }
#endif
}

// x: [tokens, heads, head_dim], rows of any stride, each head's head_dim values contiguous and heads
// head_dim apart (q and k of the fused qkv projection); cos, signed_sin: [tokens, 1, head_dim] or [tokens, head_dim].
template <typename T>
LLMSERVE_ONE_BODY void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
                                   int64_t d, int64_t ld) {
  const int64_t half = d / 2;
  team::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *c = cos + r * d, *s = sin + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + r * ld + h * d;
        T* oh = out + (r * heads + h) * d;
#if defined(__AVX512F__)
        if (half % kLanes == 0) {  // out[i] = x[i] cos[i] + x[(i + half) % d] sin[i], no wrap inside a vector
          for (int64_t i = 0; i < d; i += kLanes) {
            const int64_t j = i < half ? i + half : i - half;
            const __m512 v = _mm512_fmadd_ps(load16(xh + i, 0xFFFF), load16(c + i, 0xFFFF),
                                             _mm512_mul_ps(load16(xh + j, 0xFFFF), load16(s + i, 0xFFFF)));
            store16(oh + i, v, 0xFFFF);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < d; ++i) {
          const int64_t j = i < half ? i + half : i - half;
          oh[i] = static_cast<T>(static_cast<float>(xh[i]) * static_cast<float>(c[i]) +
                                 static_cast<float>(xh[j]) * static_cast<float>(s[i]));
        }
      }
    }
  });
}

// The gates' activations, each in float32 on 16 lanes (AVX-512) or one value: `kRoundActivation`, the activation
// rounded to the model's dtype before the product, as a reference that runs it as an op of its own does.
struct Silu {  // g / (1 + e^-g), kept in float32 up to the product
  static constexpr bool kRoundActivation = false;
#if defined(__AVX512F__)
  static __m512 vector(__m512 g) { return over_one_plus_exp_neg(g, g); }
#endif
  // e^-g clamped as the vector's: under -ffast-math (no infinities assumed) a vectorized exp's inf made NaN
  static float scalar(float g) { return g / (1.f + std::exp(std::min(-g, 88.f))); }
};

// The tanh-approximated GELU (Gemma), rounded before the product as the reference's two ops round it.
// gelu(g) = g / 2 (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), is g / (1 + e^(-2u)): SiLU's form on 2u,
// without tanh's cancellation near 0.
struct GeluTanh {
  static constexpr bool kRoundActivation = true;
  static constexpr float kTwoBeta = 2.f * 0.7978845608028654f, kKappa = 0.044715f;
#if defined(__AVX512F__)
  static __m512 vector(__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    return over_one_plus_exp_neg(
        g, _mm512_mul_ps(_mm512_set1_ps(kTwoBeta), _mm512_fmadd_ps(_mm512_set1_ps(kKappa), cube, g)));
  }
#endif
  static float scalar(float g) {
    const float two_u = kTwoBeta * (g + kKappa * g * g * g);
    return g / (1.f + std::exp(std::min(-two_u, 88.f)));
  }
};

// act(gate) * up over `rows` rows of the fused gate/up product (`ld` apart), into `out` [rows, n]
template <typename Act, typename T>
inline void gate_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n, int64_t ld) {
  team::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *gate = x + r * ld, *up = gate + n;
      T* o = out + r * n;
#if defined(__AVX512F__)
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 m = tail_mask(n - i);
        __m512 act = Act::vector(load16(gate + i, m));
        if constexpr (Act::kRoundActivation) {
          T rounded[kLanes];
          store16(rounded, act, 0xFFFF);
          act = load16(rounded, 0xFFFF);
        }
        store16(o + i, _mm512_mul_ps(act, load16(up + i, m)), m);
      }
#else
      for (int64_t i = 0; i < n; ++i) {
        float act = Act::scalar(static_cast<float>(gate[i]));
        if constexpr (Act::kRoundActivation) act = static_cast<float>(static_cast<T>(act));
        o[i] = static_cast<T>(act * static_cast<float>(up[i]));
      }
#endif
    }
  });
}

template <typename T>
LLMSERVE_ONE_BODY void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n, int64_t ld) {
  gate_and_mul_rows<Silu>(x, out, rows, n, ld);
}

template <typename T>
LLMSERVE_ONE_BODY void gelu_tanh_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n, int64_t ld) {
  gate_and_mul_rows<GeluTanh>(x, out, rows, n, ld);
}

// out[r, :] = T(y[r, :] * scales[r]): an int8 product's float32 sums times each token's activation scale, rounded
// once to the model's dtype, as `(y * row_scales).to(dtype)` computes it (int8_activations.py) in one pass
template <typename T>
LLMSERVE_ONE_BODY void scale_rows(const float* y, const float* scales, T* out, int64_t rows, int64_t n) {
  team::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* yr = y + r * n;
      T* o = out + r * n;
#if defined(__AVX512F__)
      const __m512 s = _mm512_set1_ps(scales[r]);
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 m = tail_mask(n - i);
        store16(o + i, _mm512_mul_ps(load16(yr + i, m), s), m);
      }
#else
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(yr[i] * scales[r]);
#endif
    }
  });
}

}  // namespace elementwise
}  // namespace llmserve
