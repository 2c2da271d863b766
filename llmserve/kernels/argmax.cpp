// Greedy sampling's argmax over the vocabulary, one row per sampled request.
//
// PyTorch's CPU reduction with indices along the last dimension parallelises poorly for a few long rows
// (a batch's [32, 49152] float32 logits), a visible share of a batch-32 decode step
// (docs/performance.md, "The one-call decode step"). Rows are split across threads, each scanned once with AVX-512.
//
// The first maximum wins, as in torch.argmax; NaN is never taken as a maximum (unlike torch, which returns
// it): logits with NaN have no meaningful greedy token anyway. bfloat16 rows too: a greedy step needs no float32
// copy of the head's output (widening is exact, so the same token), a pass over a cold cache.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <limits>

namespace {

// no fast-math: the scan compares against -inf, which -ffinite-math-only may assume away
#if defined(__AVX512F__)
inline __m512 load_lanes(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_lanes(const at::BFloat16* x) {  // bfloat16 is float32's upper half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

template <typename T>
__attribute__((optimize("no-fast-math"))) int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_at = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vbest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i vat = _mm512_setzero_si512();  // per lane: where its (first) maximum is
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = load_lanes(x + i);
      const __mmask16 better = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);  // strictly: earlier index kept
      vbest = _mm512_mask_mov_ps(vbest, better, v);
      vat = _mm512_mask_mov_epi32(vat, better, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    best = _mm512_reduce_max_ps(vbest);
    // the lowest index among the lanes holding the maximum
    const __mmask16 at_best = _mm512_cmp_ps_mask(vbest, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_at = _mm512_mask_reduce_min_epi32(at_best, vat);
    if (at_best == 0) best_at = 0;  // every lane -inf or NaN
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (v > best) {
      best = v;
      best_at = i;
    }
  }
  return best_at;
}

at::Tensor argmax_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "argmax_rows: x must be [rows, n] float32 or bfloat16");
  TORCH_CHECK(x_in.size(1) > 0 && x_in.size(1) <= std::numeric_limits<int32_t>::max(),
              "argmax_rows: rows must be non-empty and shorter than 2^31");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto scan = [&](const auto* xp) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
    });
  };
  if (x.scalar_type() == at::kFloat)
    scan(x.data_ptr<float>());
  else
    scan(x.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
