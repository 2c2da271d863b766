// Per-token int8 quantization of a step's activations for the int8 x int8 path (quantization/
// int8_activations.py), as one op: in eager steps (prompts) the same arithmetic as a chain of ~10 PyTorch
// ops costs ~10 op dispatches per linear layer, a large share of a prompt step
// (docs/performance.md, "Large steps: int8 activations and dense products").
//
// Bit-for-bit the PyTorch form: xs = x * smooth_inv (float32); scale = max(max|xs|, 1e-12) / 127;
// q = clamp(round_half_even(xs / scale) + 128, 1, 255). Compiled without fast-math: a division must stay a
// division (not a multiplication by the reciprocal) to round as PyTorch does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

#if defined(__AVX512F__)
inline __m512 load16(const float* x, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, x); }
inline __m512 load16(const at::BFloat16* x, __mmask16 mask) {  // bf16 is the top half of a float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x)), 16));
}
#endif

template <typename T>
__attribute__((optimize("no-fast-math"))) void quantize_rows_u8(const T* x, const float* smooth_inv, uint8_t* q,
                                                                 float* scales, int64_t rows, int64_t k) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      uint8_t* qr = q + r * k;
#if defined(__AVX512F__)
      __m512 mx = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, k - i)) - 1);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_mul_ps(load16(xr + i, mask), _mm512_maskz_loadu_ps(mask, smooth_inv + i))));
      }
      const float scale = std::max(_mm512_reduce_max_ps(mx), 1e-12f) / 127.f;
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < k; i += 16) {
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, k - i)) - 1);
        const __m512 xs = _mm512_mul_ps(load16(xr + i, mask), _mm512_maskz_loadu_ps(mask, smooth_inv + i));
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(xs, vscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, _mm512_set1_ps(128.f)), _mm512_set1_ps(1.f)),
                          _mm512_set1_ps(255.f));
        _mm_mask_storeu_epi8(qr + i, mask, _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(v)));
      }
#else
      float absmax = 0.f;
      for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(static_cast<float>(xr[i]) * smooth_inv[i]));
      const float scale = std::max(absmax, 1e-12f) / 127.f;
      for (int64_t i = 0; i < k; ++i) {
        const float v = std::nearbyint(static_cast<float>(xr[i]) * smooth_inv[i] / scale) + 128.f;
        qr[i] = static_cast<uint8_t>(std::min(std::max(v, 1.f), 255.f));
      }
#endif
      scales[r] = scale;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_activations_u8(const at::Tensor& x_in, const at::Tensor& smooth_inv_in) {
  TORCH_CHECK(x_in.dim() == 2, "quantize_activations_u8: x must be [tokens, features]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "quantize_activations_u8: x must be float32 or bfloat16");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor smooth_inv = smooth_inv_in.to(at::kFloat).contiguous();
  TORCH_CHECK(smooth_inv.numel() == x.size(1), "quantize_activations_u8: one smoothing factor per feature");
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows_u8(x.data_ptr<at::BFloat16>(), smooth_inv.data_ptr<float>(), q.data_ptr<uint8_t>(),
                     scales.data_ptr<float>(), x.size(0), x.size(1));
  } else {
    quantize_rows_u8(x.data_ptr<float>(), smooth_inv.data_ptr<float>(), q.data_ptr<uint8_t>(),
                     scales.data_ptr<float>(), x.size(0), x.size(1));
  }
  return {q, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("quantize_activations_u8(Tensor x, Tensor smooth_inv) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("quantize_activations_u8", &quantize_activations_u8);
}
