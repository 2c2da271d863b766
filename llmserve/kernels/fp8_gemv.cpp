// Weight-only products of a few activation rows with FP8 (e4m3) weights: the weight stays one byte and becomes
// float32 in registers, the activations stay as they are (float32 or bf16, not quantized).
//
// Why a kernel of our own: a decode step reads every weight once, so it runs at the rate weight bytes stream from
// memory; one byte a weight is half of bf16's. PyTorch has no weight-only fp8 product on the CPU (`_scaled_mm`
// quantizes the activations to fp8 as well), so without this the layer multiplies its dequantized copy.
//
// The conversion: an e4m3 byte s eeee mmm, sign-extended to 16 bits, shifted left by 7 and masked with 0xBF80, is
// the fp16 s 0eeee mmm0000000, whose value is the e4m3 value times 2^-8 (the exponent biases differ by 8; e4m3's
// subnormals land on fp16's subnormals, as exactly). `vcvtph2ps` (F16C: AVX-512 and AVX2 hosts alike, no
// AVX512-FP16 needed) widens it to float32, and the 2^8 goes into the block scales (exact). e4m3fn's NaN bytes
// (0x7F, 0xFF) read as 480: the loader refuses a weight with NaNs.
//
// Layout (`pack_fp8`, kernels/fp8_gemv.py), per row block of 16 output rows (one float32 lane each, so no horizontal
// sums), per block of 128 inputs (the last one shorter where the inputs are not a multiple of 128): the 16 rows'
// scales of that block as float32 (times 2^8), then for each input of the block its 16 rows' bytes. A per-tensor or
// per-channel weight repeats its scale in every block; a DeepSeek-style 128 x 128 block weight holds its own.
// Per block the product sums x * w in float32 per row, then multiplies the sum by the block's scale.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "team.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LLMSERVE_FP8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMSERVE_FP8_AVX2 1  // hosts without AVX-512 (AMD Zen 2/3, older Intel): 8-lane loops
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

namespace {

constexpr int64_t kRows = 16;          // output rows per row block
constexpr int64_t kBlock = 128;        // inputs per scale
constexpr int64_t kScaleBytes = kRows * 4;
constexpr int64_t kMaxTokens = 8;      // tokens per pass over the weights (accumulators in registers)
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kTileBytes = 256 * 1024;  // a step of more tokens passes over tiles that stay in L2

int64_t block_count(int64_t k) { return (k + kBlock - 1) / kBlock; }
int64_t row_block_bytes(int64_t k) { return k * kRows + block_count(k) * kScaleBytes; }

// The fp16 bits of an e4m3 byte's value times 2^-8 (see the header)
inline uint16_t fp8_as_half_bits(uint8_t b) {
  return static_cast<uint16_t>((static_cast<int16_t>(static_cast<int8_t>(b)) << 7) & 0xBF80);
}

// The same as a 256-entry table of float32 (the portable loop)
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(c10::Half(fp8_as_half_bits(static_cast<uint8_t>(b)), c10::Half::from_bits()));
    return t;
  }();
  return table;
}

template <typename T>
inline void store_rows(T* out, const float* rows) {
  for (int r = 0; r < kRows; ++r) out[r] = static_cast<T>(rows[r]);
}

// Row blocks split between the threads (the decode stack's team where one is held), each a contiguous stream;
// each runs `pass(first_token, tokens, block_begin, block_end)` per tile and kMaxTokens tokens
template <typename Pass>
void for_token_passes(int64_t num_blocks, int64_t m, int64_t block_bytes, const Pass& pass) {
  const int64_t tile = m <= kMaxTokens ? num_blocks : std::max<int64_t>(1, kTileBytes / block_bytes);
  llmserve::team::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += tile) {
      const int64_t tile_end = std::min(end, b + tile);
      for (int64_t t0 = 0; t0 < m; t0 += kMaxTokens) pass(t0, std::min(kMaxTokens, m - t0), b, tile_end);
    }
  });
}

template <int M, typename Kernel>
void with_token_count(int64_t m, const Kernel& kernel) {
  if constexpr (M > 1) {
    if (m < M) return with_token_count<M - 1>(m, kernel);
  }
  kernel(std::integral_constant<int, M>{});
}

// x: float32 [m, k] (the tokens of this pass), out: [m, n] in T
template <typename T>
void fp8_rows_portable(const uint8_t* w, const float* x, T* out, int64_t m, int64_t k, int64_t n,
                       int64_t block_begin, int64_t block_end) {
  const std::array<float, 256>& table = fp8_table();
  const int64_t bytes = row_block_bytes(k);
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t t = 0; t < m; ++t) {
      float total[kRows] = {};
      const uint8_t* p = w + b * bytes;
      for (int64_t i0 = 0; i0 < k; i0 += kBlock) {
        const float* scale = reinterpret_cast<const float*>(p);
        p += kScaleBytes;
        float sum[kRows] = {};
        for (int64_t i = i0; i < std::min(k, i0 + kBlock); ++i, p += kRows) {
          for (int r = 0; r < kRows; ++r) sum[r] += table[p[r]] * x[t * k + i];
        }
        for (int r = 0; r < kRows; ++r) total[r] += sum[r] * scale[r];
      }
      store_rows(out + t * n + b * kRows, total);
    }
  }
}

#if LLMSERVE_FP8_AVX512
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T2);
}

// 32 bytes (two inputs' 16 rows) as two vectors of 16 float32 (times 2^-8)
inline void widen_two(const uint8_t* p, __m512& first, __m512& second) {
  const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i half = _mm512_and_si512(_mm512_slli_epi16(wide, 7), _mm512_set1_epi16(static_cast<int16_t>(0xBF80)));
  first = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  second = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
}

// Four inputs a step, each token's products over two chains by the input's position (even, odd): a token's sums
// are the same whatever the pass's other tokens, so its output has the same bits in any step (the build plan's
// determinism with quantized large steps)
template <int M, typename T>
void fp8_rows_avx512(const uint8_t* w, const float* x, T* out, int64_t k, int64_t n, int64_t block_begin,
                     int64_t block_end) {
  constexpr int S = 2;
  const int64_t bytes = row_block_bytes(k);
  for (int64_t b = block_begin; b < block_end; ++b) {
    const uint8_t* p = w + b * bytes;
    __m512 total[M];
    for (int t = 0; t < M; ++t) total[t] = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < k; i0 += kBlock) {
      const int64_t len = std::min(kBlock, k - i0);
      const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
      p += kScaleBytes;
      prefetch_ahead(p, len * kRows);
      __m512 acc[M][S];
      for (int t = 0; t < M; ++t)
        for (int s = 0; s < S; ++s) acc[t][s] = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 4 <= len; i += 4, p += 4 * kRows) {
        __m512 v[4];
        widen_two(p, v[0], v[1]);
        widen_two(p + 2 * kRows, v[2], v[3]);
        for (int j = 0; j < 4; ++j) {
          for (int t = 0; t < M; ++t) {
            acc[t][j % S] = _mm512_fmadd_ps(v[j], _mm512_set1_ps(x[t * k + i0 + i + j]), acc[t][j % S]);
          }
        }
      }
      for (; i < len; ++i, p += kRows) {  // a block's inputs past a multiple of 4
        const __m256i half = _mm256_and_si256(
            _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7),
            _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
        const __m512 v = _mm512_cvtph_ps(half);
        for (int t = 0; t < M; ++t)
          acc[t][i % S] = _mm512_fmadd_ps(v, _mm512_set1_ps(x[t * k + i0 + i]), acc[t][i % S]);
      }
      for (int t = 0; t < M; ++t) total[t] = _mm512_fmadd_ps(_mm512_add_ps(acc[t][0], acc[t][1]), scale, total[t]);
    }
    alignas(64) float rows[kRows];
    for (int t = 0; t < M; ++t) {
      _mm512_store_ps(rows, total[t]);
      store_rows(out + t * n + b * kRows, rows);
    }
  }
}
#endif

#if LLMSERVE_FP8_AVX2
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  const char* ahead = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T2);
}

// 8-lane loops: an input's 16 rows are two vectors; at most 4 tokens a pass (16 registers)
template <int M, typename T>
void fp8_rows_avx2(const uint8_t* w, const float* x, T* out, int64_t k, int64_t n, int64_t block_begin,
                   int64_t block_end) {
  const int64_t bytes = row_block_bytes(k);
  const __m256i mask = _mm256_set1_epi16(static_cast<int16_t>(0xBF80));
  for (int64_t b = block_begin; b < block_end; ++b) {
    const uint8_t* p = w + b * bytes;
    alignas(32) float total[M][kRows] = {};
    for (int64_t i0 = 0; i0 < k; i0 += kBlock) {
      const int64_t len = std::min(kBlock, k - i0);
      const float* scale = reinterpret_cast<const float*>(p);
      p += kScaleBytes;
      prefetch_ahead(p, len * kRows);
      __m256 acc[M][2];
      for (int t = 0; t < M; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
      for (int64_t i = 0; i < len; ++i, p += kRows) {
        const __m256i half = _mm256_and_si256(
            _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7), mask);
        const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
        const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
        for (int t = 0; t < M; ++t) {
          const __m256 xv = _mm256_set1_ps(x[t * k + i0 + i]);
          acc[t][0] = _mm256_fmadd_ps(lo, xv, acc[t][0]);
          acc[t][1] = _mm256_fmadd_ps(hi, xv, acc[t][1]);
        }
      }
      const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
      for (int t = 0; t < M; ++t) {
        _mm256_store_ps(total[t], _mm256_fmadd_ps(acc[t][0], s0, _mm256_load_ps(total[t])));
        _mm256_store_ps(total[t] + 8, _mm256_fmadd_ps(acc[t][1], s1, _mm256_load_ps(total[t] + 8)));
      }
    }
    for (int t = 0; t < M; ++t) store_rows(out + t * n + b * kRows, total[t]);
  }
}
#endif

template <typename T>
void fp8_product(const float* x, const uint8_t* w, T* out, int64_t m, int64_t k, int64_t n, bool portable) {
  const int64_t num_blocks = n / kRows;
  if (portable) return fp8_rows_portable(w, x, out, m, k, n, 0, num_blocks);
  for_token_passes(num_blocks, m, row_block_bytes(k), [&](int64_t t0, int64_t mt, int64_t begin, int64_t end) {
#if LLMSERVE_FP8_AVX512
    with_token_count<kMaxTokens>(mt, [&](auto tokens) {
      fp8_rows_avx512<decltype(tokens)::value, T>(w, x + t0 * k, out + t0 * n, k, n, begin, end);
    });
#elif LLMSERVE_FP8_AVX2
    for (int64_t t = t0; t < t0 + mt; t += 4) {
      with_token_count<4>(std::min<int64_t>(4, t0 + mt - t), [&](auto tokens) {
        fp8_rows_avx2<decltype(tokens)::value, T>(w, x + t * k, out + t * n, k, n, begin, end);
      });
    }
#else
    fp8_rows_portable(w, x + t0 * k, out + t0 * n, mt, k, n, begin, end);
#endif
  });
}

at::Tensor fp8_gemv_impl(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool portable) {
  TORCH_CHECK(x.dim() == 2, "fp8_gemv: x must be a [tokens, in_features] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "fp8_gemv: x must be float32 or bfloat16");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(n % kRows == 0 && k > 0, "fp8_gemv: out_features must be a multiple of 16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.numel() == n / kRows * row_block_bytes(k),
              "fp8_gemv: packed weight does not match [", n, ", ", k, "]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16) {
    fp8_product(xf.data_ptr<float>(), w, out.data_ptr<at::BFloat16>(), m, k, n, portable);
  } else {
    fp8_product(xf.data_ptr<float>(), w, out.data_ptr<float>(), m, k, n, portable);
  }
  return out;
}

// x [tokens, k] times the fp8 weight packed by `pack_fp8` (kernels/fp8_gemv.py): [tokens, n] in x's dtype.
// `activation_parts` is the other quantized products' argument, unused: the activations are not quantized.
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t activation_parts) {
  (void)activation_parts;
  return fp8_gemv_impl(x, packed, n, false);
}

// The same product through the portable loop (the 256-entry table), single-threaded: what the vector loops are
// tested against, and what a host without AVX2 runs.
at::Tensor fp8_gemv_portable(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t activation_parts) {
  (void)activation_parts;
  return fp8_gemv_impl(x, packed, n, true);
}

// Which loop `fp8_gemv` runs on this build: "avx512", "avx2" or "portable"
std::string fp8_gemv_path() {
#if LLMSERVE_FP8_AVX512
  return "avx512";
#elif LLMSERVE_FP8_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("fp8_gemv(Tensor x, Tensor packed, int n, int activation_parts=2) -> Tensor");
  m.def("fp8_gemv_portable(Tensor x, Tensor packed, int n, int activation_parts=2) -> Tensor");
  m.def("fp8_gemv_path() -> str");
}

TORCH_LIBRARY_IMPL(llmserve, CompositeExplicitAutograd, m) {
  m.impl("fp8_gemv_path", &fp8_gemv_path);
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("fp8_gemv", &fp8_gemv);
  m.impl("fp8_gemv_portable", &fp8_gemv_portable);
}
