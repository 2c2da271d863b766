// The decoder layer's elementwise work as four ops, for the steps that run eagerly (prompts, and a busy
// server's steps that prefill one request beside the decodes). Eager PyTorch spends ~25 small kernels a
// layer on RMSNorm (casts, square, mean, rsqrt, products), rotary (two products, a roll, a sum) and the
// SwiGLU gate (a slow bf16 SiLU, a product): at c=32 about 15 ms of a 52 ms mixed step, nearly all of it
// dispatch and OpenMP wake-ups. Each op here reads its inputs once and writes once, in float32 inside,
// rounding to the tensor's dtype only at the end (as Inductor's fused loops do; eager rounds after every
// op). The compiled decode graph does not use them: Inductor fuses the same ops there itself.
// Measured (benchmarks/mixed_step.py, one engine, alternated): a mixed step of 31 decodes and a prompt
// 57.8 -> 49.0 ms, an eager batch-31 decode step 38.2 -> 33.3 ms.
//
//   rms_norm(x, w, eps)            w * x / sqrt(mean(x^2) + eps), per row
//   add_rms_norm(x, d, w, eps)     (x + d, rms_norm(x + d)): the residual add and the next norm in one pass
//   rotary(x, cos, signed_sin)     x * cos + roll(x, head_dim / 2) * signed_sin, per head (rotate-half RoPE)
//   silu_and_mul(gate_up)          silu(gate) * up, the two halves of the fused gate/up projection

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// rows per parallel chunk: ~16K elements, so a step of a few tokens stays on one thread
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

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
#endif

// One row of RMSNorm: out = w * x * rsqrt(mean(x^2) + eps); `sum_out`, when given, receives x itself
// (the residual stream), x being `a + b` when `b` is given.
template <typename T, typename W>
void rms_norm_row(const T* a, const T* b, const W* w, T* out, T* sum_out, int64_t n, float eps) {
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
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = tail_mask(n - i);
    store16(out + i, _mm512_mul_ps(load16(w + i, m), _mm512_mul_ps(load16(src + i, m), r)), m);
  }
#else
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    float x = static_cast<float>(a[i]);
    if (b != nullptr) {
      sum_out[i] = static_cast<T>(x + static_cast<float>(b[i]));
      x = static_cast<float>(sum_out[i]);
    }
    acc += x * x;
  }
  const float r = 1.f / std::sqrt(acc / static_cast<float>(n) + eps);
  const T* src = b != nullptr ? sum_out : a;
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(w[i]) * (static_cast<float>(src[i]) * r));
#endif
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [tokens, features] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only (other dtypes take the PyTorch path)");
}

template <typename F>
void dispatch_dtype(const at::Tensor& x, const at::Tensor& w, F&& body) {
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "a float32 x needs a float32 weight");
    body(float{}, float{});
  } else if (w.scalar_type() == at::kFloat) {
    body(at::BFloat16{}, float{});
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "weight must be float32 or bfloat16");
    body(at::BFloat16{}, at::BFloat16{});
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight_in, double eps) {
  check_rows(x, "rms_norm");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n, "rms_norm: one weight per feature");
  at::Tensor out = at::empty({rows, n}, x.options());
  dispatch_dtype(x, weight, [&](auto t, auto wt) {
    using T = decltype(t);
    using W = decltype(wt);
    const T* xp = x.data_ptr<T>();
    const W* wp = weight.data_ptr<W>();
    T* op = out.data_ptr<T>();
    const int64_t ld = x.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<T, W>(xp + r * ld, nullptr, wp, op + r * n, nullptr, n, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& delta_in,
                                                const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), delta = delta_in.contiguous(), weight = weight_in.contiguous();
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and delta must have the same shape and dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n, "add_rms_norm: one weight per feature");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  dispatch_dtype(x, weight, [&](auto t, auto wt) {
    using T = decltype(t);
    using W = decltype(wt);
    const T *xp = x.data_ptr<T>(), *dp = delta.data_ptr<T>();
    const W* wp = weight.data_ptr<W>();
    T *sp = sum.data_ptr<T>(), *op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<T, W>(xp + r * n, dp + r * n, wp, op + r * n, sp + r * n, n, static_cast<float>(eps));
    });
  });
  return {sum, out};
}

// x: [tokens, heads, head_dim], rows of any stride, each head's head_dim values contiguous and heads
// head_dim apart (q and k of the fused qkv projection); cos, signed_sin: [tokens, 1, head_dim] or [tokens, head_dim].
template <typename T>
void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads, int64_t d,
                 int64_t ld) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
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

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x must be [tokens, heads, head_dim] with each row's heads contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotary: float32 or bfloat16 only");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary: head_dim must be even");
  const at::Tensor cos = cos_in.to(x.scalar_type()).contiguous(), sin = sin_in.to(x.scalar_type()).contiguous();
  TORCH_CHECK(cos.numel() == rows * d && sin.numel() == rows * d, "rotary: one cos and sin row per token");
  at::Tensor out = at::empty({rows, heads, d}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rotary_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(), rows,
                heads, d, x.stride(0));
  } else {
    rotary_rows(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), rows, heads, d, x.stride(0));
  }
  return out;
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n, int64_t ld) {
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *gate = x + r * ld, *up = gate + n;
      T* o = out + r * n;
#if defined(__AVX512F__)
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 g = load16(gate + i, m);
        // g / (1 + e^-g), the division as a reciprocal estimate and one Newton step (~1 ulp): a 512-bit
        // division has 16-cycle throughput, which bound the whole op
        const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.f));  // no inf
        const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg));
        __m512 inv = _mm512_rcp14_ps(den);
        inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
        const __m512 silu = _mm512_mul_ps(g, inv);
        store16(o + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
      }
#else
      for (int64_t i = 0; i < n; ++i) {
        const float g = static_cast<float>(gate[i]);
        // e^-g clamped as above: under -ffast-math (no infinities assumed) a vectorized exp's inf made NaN
        o[i] = static_cast<T>(g / (1.f + std::exp(std::min(-g, 88.f))) * static_cast<float>(up[i]));
      }
#endif
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x must be [tokens, 2 * features]");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, n, x.stride(0));
  } else {
    silu_and_mul_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n, x.stride(0));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
}
