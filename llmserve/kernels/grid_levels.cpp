// A weight's levels on a given quantization grid, and the values they stand for, in one pass over the weight.
//
// Why: every start re-derives the levels of the file's int4 (Q4_0/Q4_1/Q4_K) and int8-held (Q6_K, Q8_0, Q5_0)
// weights from their decoded values. PyTorch's ops made it six passes over a float32 copy of each weight (widen,
// subtract, divide, round, clamp, and the dequantized values' multiply and add), each fresh tensor paying its page
// faults, seconds of a larger model's start (docs/performance.md, "Start-up"). Here each thread reads its rows once
// and writes the levels, and for int4 the dequantized values.
//
// The arithmetic is PyTorch's, operation for operation, in float32 with IEEE rounding (no fast-math, no fused
// multiply-add), so the levels and values are the ones `weight_only.py`'s PyTorch path computes, bit for bit
// (tests/kernels/test_grid_levels.py):
//   int4: q = clamp(round((w - lo) / step), 0, 15), step = scale where scale > 0 else 1;
//         value = q * value_scale + value_lo (two roundings), in the weight's dtype;
//   on a grid of one scale per run of inputs (Q6_K's d * sc per 16, Q8_0's and Q5_0's d per 32), integers in
//   [lowest, highest]: q = clamp(round(w / step), lowest, highest), step = scale where scale != 0 else 1;
//   q stored as q - lowest (an unsigned byte), and whether q * scale in the weight's dtype is the weight everywhere
//   (the values themselves are then the weight: no copy written, none compared after).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "elementwise.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

constexpr int64_t kInt4Group = 32;

// bfloat16 <-> float32 as bit operations the loops vectorize (c10::BFloat16's conversions keep the loops scalar,
// and their clamps become branches), with c10's rounding: to nearest even, NaN quiet
LLMSERVE_IEEE_LOOPS inline float widen(float x) { return x; }
LLMSERVE_IEEE_LOOPS inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
LLMSERVE_IEEE_LOOPS inline void narrow(float v, float* out) { *out = v; }
LLMSERVE_IEEE_LOOPS inline void narrow(float v, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + ((bits >> 16) & 1) + 0x7FFFu) >> 16);
  *out = v != v ? static_cast<uint16_t>(0x7FC0) : rounded;
}

template <typename T>
LLMSERVE_IEEE_LOOPS void int4_rows(const T* w, const float* scale, const float* lo, const float* value_scale,
                             const float* value_lo, uint8_t* q, T* value, int64_t row_begin, int64_t row_end,
                             int64_t in) {
  const int64_t groups = in / kInt4Group;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * groups + g;
      const float step = scale[at] > 0.f ? scale[at] : 1.f;
      const float low = lo[at], vs = value_scale[at], vl = value_lo[at];
      const int64_t base = r * in + g * kInt4Group;
#pragma GCC ivdep
      for (int64_t i = 0; i < kInt4Group; ++i) {
        float level = __builtin_nearbyintf((widen(w[base + i]) - low) / step);
        level = level < 0.f ? 0.f : (level > 15.f ? 15.f : level);  // not std::min/max: not inlined here
        q[base + i] = static_cast<uint8_t>(level);
        const float product = level * vs;
        narrow(product + vl, value + base + i);
      }
    }
  }
}

// Returns whether every value q * scale, in the weight's dtype, equals the weight (as `torch.equal`: by value).
// `Run`: the inputs per scale where known when compiled (Q6_K's 16, Q8_0's and Q5_0's 32), else 0: with a fixed trip
// count GCC vectorizes the loop at its full width, with a runtime one on 128-bit vectors.
template <int64_t Run, typename T>
LLMSERVE_IEEE_LOOPS bool signed_rows(const T* w, const float* scale, float lowest, float highest, uint8_t* q,
                                     int64_t row_begin, int64_t row_end, int64_t in, int64_t runtime_run) {
  const int64_t run = Run > 0 ? Run : runtime_run;
  const int64_t runs = in / run;
  int off_grid = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t s = 0; s < runs; ++s) {
      const float sc = scale[r * runs + s];
      const float step = sc != 0.f ? sc : 1.f;
      const int64_t base = r * in + s * run;
#pragma GCC ivdep
      for (int64_t i = 0; i < run; ++i) {
        const float weight = widen(w[base + i]);
        float level = __builtin_nearbyintf(weight / step);
        level = level < lowest ? lowest : (level > highest ? highest : level);
        q[base + i] = static_cast<uint8_t>(static_cast<int32_t>(level - lowest));
        T value;
        narrow(level * sc, &value);
        off_grid |= widen(value) != weight;
      }
    }
  }
  return off_grid == 0;
}

void check_weight(const at::Tensor& w, int64_t group, const char* op) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), op, ": the weight must be a contiguous [out, in] tensor");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, op,
              ": the weight must be float32 or bfloat16");
  TORCH_CHECK(w.size(1) % group == 0, op, ": in_features must be a multiple of ", group);
}

void check_grid(const at::Tensor& g, const at::Tensor& w, int64_t group, const char* op) {
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.is_contiguous() && g.dim() == 2 && g.size(0) == w.size(0) &&
                  g.size(1) == w.size(1) / group,
              op, ": each grid tensor must be contiguous float32 [out, in / ", group, "]");
}

// Calls f(weights) with float32's storage or bfloat16's bits (uint16_t)
template <typename F>
void with_weight(const at::Tensor& w, const F& f) {
  if (w.scalar_type() == at::kFloat) return f(w.data_ptr<float>());
  f(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()));
}

// Calls f(weights, values), the values a tensor of the weight's dtype, stored the same way
template <typename F>
void with_storage(const at::Tensor& w, at::Tensor& value, const F& f) {
  with_weight(w, [&](const auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    f(wp, static_cast<T*>(value.data_ptr()));
  });
}

// rows a thread takes at a time: whole rows, ~64 Ki values
int64_t grain(const at::Tensor& w) { return std::max<int64_t>(1, (1 << 16) / w.size(1)); }

std::tuple<at::Tensor, at::Tensor> int4_levels(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& lo,
                                                const at::Tensor& value_scale, const at::Tensor& value_lo) {
  check_weight(w, kInt4Group, "int4_levels");
  for (const auto* g : {&scale, &lo, &value_scale, &value_lo}) check_grid(*g, w, kInt4Group, "int4_levels");
  at::Tensor q = at::empty(w.sizes(), w.options().dtype(at::kByte));
  at::Tensor value = at::empty_like(w);
  const int64_t in = w.size(1);
  with_storage(w, value, [&](const auto* wp, auto* vp) {
    at::parallel_for(0, w.size(0), grain(w), [&](int64_t begin, int64_t end) {
      int4_rows(wp, scale.data_ptr<float>(), lo.data_ptr<float>(), value_scale.data_ptr<float>(),
                value_lo.data_ptr<float>(), q.data_ptr<uint8_t>(), vp, begin, end, in);
    });
  });
  return {q, value};
}

std::tuple<at::Tensor, bool> signed_levels(const at::Tensor& w, const at::Tensor& scale, int64_t lowest,
                                           int64_t highest) {
  TORCH_CHECK(lowest <= 0 && 0 <= highest && highest - lowest <= 255, "signed_levels: [lowest, highest] must hold 0 "
              "and at most 256 integers, got [", lowest, ", ", highest, "]");
  check_weight(w, 1, "signed_levels");
  TORCH_CHECK(scale.dim() == 2 && scale.size(1) > 0 && w.size(1) % scale.size(1) == 0,
              "signed_levels: the scale must be [out, runs], the runs dividing in_features");
  const int64_t run = w.size(1) / scale.size(1);
  check_grid(scale, w, run, "signed_levels");
  at::Tensor q = at::empty(w.sizes(), w.options().dtype(at::kByte));
  const int64_t in = w.size(1);
  std::atomic<bool> exact{true};
  with_weight(w, [&](const auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    const auto loop = run == 16 ? signed_rows<16, T> : run == 32 ? signed_rows<32, T> : signed_rows<0, T>;
    at::parallel_for(0, w.size(0), grain(w), [&](int64_t begin, int64_t end) {
      if (!loop(wp, scale.data_ptr<float>(), static_cast<float>(lowest), static_cast<float>(highest),
                q.data_ptr<uint8_t>(), begin, end, in, run)) {
        exact = false;
      }
    });
  });
  return {q, exact.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("int4_levels(Tensor w, Tensor scale, Tensor lo, Tensor value_scale, Tensor value_lo) -> (Tensor, Tensor)");
  m.def("signed_levels(Tensor w, Tensor scale, int lowest, int highest) -> (Tensor, bool)");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("int4_levels", &int4_levels);
  m.impl("signed_levels", &signed_levels);
}
