// int8 activations x int8 weights (the int8-activation path, quantization/int8_activations.py) on AMX.
//
// Why a kernel of our own: a busy server's decode step (32 tokens) multiplies by ~106 MB of int8 weights
// per step, streamed from memory. oneDNN's AMX matmul, called through `onednn::qlinear_pointwise`, reads
// them well short of the rate memory delivers, and the op adds a fixed cost per call on top of its own time:
// together a large share of a batch-32 step. Here the weight is stored in the order the tile loads consume it,
// one contiguous stream per thread, prefetched ahead, and the epilogue (zero-point compensation, weight and token
// scales, the cast to the model dtype) is fused
// (docs/performance.md, "Large steps: int8 activations and dense products"; benchmarks/quantized_gemv.py --amx-int8). What keeps it from the memory's rate is the tile products themselves not
// overlapping the memory reads fully.
//
// Math, the same as oneDNN's (the tests check it bit for bit against the `onednn::qlinear_pointwise` path):
//     acc[m, n] = sum_k xu[m, k] * w[n, k]            exact int32; xu = x_q + 128 in [1, 255]
//     y[m, n]   = (float(acc - 128 * sum_k w[n, k]) * w_scale[n]) * row_scale[m], rounded to the dtype
//
// Packed weight layout (`pack_int8_for_amx` in kernels/int8_gemm.py): per strip of 32 output channels,
// per step of 64 inputs, two 1 KiB B tiles (channels 0-15, 16-31 of the strip); tile row r holds, for each
// of its 16 channels, the 4 weights of inputs 4r..4r+3 (the VNNI order `tdpbusd` reads).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AMX_TILE__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LLMSERVE_AMX_TILES 1
#if defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define LLMSERVE_GEMM_AMX 1
#endif
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if LLMSERVE_AMX_TILES
// Linux hands out AMX's tile state only on request, once per process (paged_attention.cpp asks here too).
bool request_amx_tiles() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}
#endif

namespace {

constexpr int64_t kStrip = 32;   // output channels per strip (two B tiles)
constexpr int64_t kStep = 64;    // inputs per tile step
constexpr int64_t kRowBlock = 32;  // activation rows per pass over a strip (two A tiles)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the tile loads the weight stream is prefetched

void check_inputs(const at::Tensor& xu, const at::Tensor& row_scales, const at::Tensor& packed,
                  const at::Tensor& w_scales, const at::Tensor& compensation, const char* op) {
  TORCH_CHECK(xu.dim() == 2 && xu.scalar_type() == at::kByte, op, ": xu must be [tokens, in_features] uint8");
  const int64_t m = xu.size(0), k = xu.size(1), n = w_scales.numel();
  TORCH_CHECK(k % kStep == 0, op, ": in_features must be a multiple of ", kStep, ", got ", k);
  TORCH_CHECK(n % kStrip == 0, op, ": out_features must be a multiple of ", kStrip, ", got ", n);
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.numel() == m, op,
              ": row_scales must hold one float32 per token");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.numel() == n * k, op,
              ": packed weight does not match [", n, ", ", k, "]");
  TORCH_CHECK(w_scales.scalar_type() == at::kFloat && w_scales.is_contiguous(), op,
              ": w_scales must be float32");
  TORCH_CHECK(compensation.scalar_type() == at::kInt && compensation.is_contiguous() && compensation.numel() == n,
              op, ": compensation must be [", n, "] int32");
}

// The epilogue of one value, in the order oneDNN rounds it (no fast-math: no reassociation of the scales).
__attribute__((optimize("no-fast-math"))) inline float dequantize(int32_t acc, int32_t comp, float w_scale,
                                                                  float row_scale) {
  const float v = static_cast<float>(acc - comp) * w_scale;
  return v * row_scale;
}

template <typename T>
void gemm_portable(const uint8_t* x, const float* row_scales, const int8_t* packed, const float* w_scales,
                   const int32_t* comp, T* out, int64_t m, int64_t k, int64_t n) {
  const int64_t steps = k / kStep;
  at::parallel_for(0, n / kStrip, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t c = 0; c < kStrip; ++c) {
        const int64_t col = s * kStrip + c, tile = c / 16, lane = c % 16;
        for (int64_t r = 0; r < m; ++r) {
          int32_t acc = 0;
          for (int64_t j = 0; j < steps; ++j) {
            const int8_t* b = packed + ((s * steps + j) * 2 + tile) * 1024;
            for (int64_t i = 0; i < kStep; ++i)
              acc += static_cast<int32_t>(x[r * k + j * kStep + i]) * b[(i / 4) * 64 + lane * 4 + i % 4];
          }
          out[r * n + col] = static_cast<T>(dequantize(acc, comp[col], w_scales[col], row_scales[r]));
        }
      }
  });
}

#if LLMSERVE_GEMM_AMX

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: int32 sums (rows 0-15 x strip half 0, rows 0-15 x half 1, rows 16-31 x half 0, x half 1);
// 4, 5: the two 16-row activation tiles; 6, 7: the strip's two weight tiles. All 16 rows x 64 bytes.
const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  return config;
}

inline void store_row(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
inline void store_row(at::BFloat16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

// out rows [r0, r0 + rows) of one strip from the 32 x 32 int32 sums (the scale order of `dequantize`)
template <typename T>
__attribute__((optimize("no-fast-math"))) void strip_epilogue(const int32_t* sums, const float* row_scales,
                                                              const float* w_scales, const int32_t* comp, T* out,
                                                              int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 row_scale = _mm512_set1_ps(row_scales[r]);
    for (int half = 0; half < 2; ++half) {
      const __m512i acc = _mm512_sub_epi32(_mm512_loadu_si512(sums + r * kStrip + 16 * half),
                                           _mm512_loadu_si512(comp + 16 * half));
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_loadu_ps(w_scales + 16 * half));
      store_row(out + r * n + 16 * half, _mm512_mul_ps(v, row_scale));
    }
  }
}

// `tail`: the last rows of x when m is not a multiple of 32, copied into a zero-padded 32-row block (the
// tile loads read whole blocks); nullptr otherwise.
template <typename T>
void gemm_amx(const uint8_t* x, const uint8_t* tail, const float* row_scales, const int8_t* packed,
              const float* w_scales, const int32_t* comp, T* out, int64_t m, int64_t k, int64_t n) {
  const int64_t steps = k / kStep, strip_bytes = steps * 2 * 1024, tail_row = m / kRowBlock * kRowBlock;
  at::parallel_for(0, n / kStrip, 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&tile_config());
    alignas(64) int32_t sums[kRowBlock * kStrip];
    for (int64_t s = begin; s < end; ++s) {
      const int8_t* w = packed + s * strip_bytes;
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const uint8_t* a0 = r0 == tail_row ? tail : x + r0 * k;
        const uint8_t* a1 = a0 + 16 * k;
        const bool upper_only = m - r0 <= 16;  // rows 16-31 all padding: half the tile products
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < steps; ++j) {
          const int8_t* b = w + j * 2048;
          if (r0 == 0)  // the stream this thread reads next; later row blocks find the strip in cache
            for (int line = 0; line < 2048; line += 64) _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchBytes + line, _MM_HINT_T0);
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 1024, 64);
          _tile_loadd(4, a0 + j * kStep, k);
          _tile_dpbusd(0, 4, 6);
          _tile_dpbusd(1, 4, 7);
          if (upper_only) continue;
          _tile_loadd(5, a1 + j * kStep, k);
          _tile_dpbusd(2, 5, 6);
          _tile_dpbusd(3, 5, 7);
        }
        _tile_stored(0, sums, kStrip * 4);
        _tile_stored(1, sums + 16, kStrip * 4);
        _tile_stored(2, sums + 16 * kStrip, kStrip * 4);
        _tile_stored(3, sums + 16 * kStrip + 16, kStrip * 4);
        strip_epilogue(sums, row_scales + r0, w_scales + s * kStrip, comp + s * kStrip, out + r0 * n + s * kStrip,
                       std::min(kRowBlock, m - r0), n);
      }
    }
    _tile_release();
  });
}
#endif

bool int8_gemm_amx_available() {
#if LLMSERVE_GEMM_AMX
  return request_amx_tiles();
#else
  return false;
#endif
}

at::Tensor int8_gemm_impl(const at::Tensor& xu_in, const at::Tensor& row_scales_in, const at::Tensor& packed,
                          const at::Tensor& w_scales, const at::Tensor& compensation, at::ScalarType out_dtype,
                          bool portable) {
  const char* op = portable ? "int8_gemm_portable" : "int8_gemm";
  check_inputs(xu_in, row_scales_in, packed, w_scales, compensation, op);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, op, ": out_dtype must be float32 or bfloat16");
  TORCH_CHECK(portable || int8_gemm_amx_available(), op, ": this build or CPU has no AMX; use int8_gemm_portable");
  const int64_t m = xu_in.size(0), k = xu_in.size(1), n = w_scales.numel();
  const at::Tensor row_scales = row_scales_in.contiguous();
  at::Tensor out = at::empty({m, n}, xu_in.options().dtype(out_dtype));
  const at::Tensor xu = xu_in.contiguous();
  // the tile loads read whole 32-row blocks: a last partial block is copied into zero-padded rows, in a
  // buffer this thread keeps (not an allocation per call)
  thread_local std::vector<uint8_t> tail_rows;
  const uint8_t* tail = nullptr;
  if (!portable && m % kRowBlock != 0) {
    tail_rows.assign(kRowBlock * k, 0);
    const int64_t first = m / kRowBlock * kRowBlock;
    std::memcpy(tail_rows.data(), xu.data_ptr<uint8_t>() + first * k, (m - first) * k);
    tail = tail_rows.data();
  }
  const uint8_t* x = xu.data_ptr<uint8_t>();
  const float* rs = row_scales.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* ws = w_scales.data_ptr<float>();
  const int32_t* comp = compensation.data_ptr<int32_t>();
  auto run = [&](auto* o) {
#if LLMSERVE_GEMM_AMX
    if (!portable) return gemm_amx(x, tail, rs, w, ws, comp, o, m, k, n);
#endif
    gemm_portable(x, rs, w, ws, comp, o, m, k, n);
  };
  if (out_dtype == at::kBFloat16) {
    run(out.data_ptr<at::BFloat16>());
  } else {
    run(out.data_ptr<float>());
  }
  return out;
}

// xu [tokens, k] (uint8, zero point 128) times the int8 weight packed by `pack_int8_for_amx`, with its
// scales and compensation (128 * each channel's weight sum); row_scales [tokens] or [tokens, 1].
at::Tensor int8_gemm(const at::Tensor& xu, const at::Tensor& row_scales, const at::Tensor& packed,
                     const at::Tensor& w_scales, const at::Tensor& compensation, at::ScalarType out_dtype) {
  return int8_gemm_impl(xu, row_scales, packed, w_scales, compensation, out_dtype, false);
}

at::Tensor int8_gemm_portable(const at::Tensor& xu, const at::Tensor& row_scales, const at::Tensor& packed,
                              const at::Tensor& w_scales, const at::Tensor& compensation, at::ScalarType out_dtype) {
  return int8_gemm_impl(xu, row_scales, packed, w_scales, compensation, out_dtype, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("int8_gemm_amx_available() -> bool");
  m.def("int8_gemm(Tensor xu, Tensor row_scales, Tensor packed, Tensor w_scales, Tensor compensation, "
        "ScalarType out_dtype) -> Tensor");
  m.def("int8_gemm_portable(Tensor xu, Tensor row_scales, Tensor packed, Tensor w_scales, Tensor compensation, "
        "ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CompositeExplicitAutograd, m) {
  m.impl("int8_gemm_amx_available", &int8_gemm_amx_available);
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int8_gemm_portable", &int8_gemm_portable);
}
