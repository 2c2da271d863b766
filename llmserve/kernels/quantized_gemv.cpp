// Weight-only quantized products of a few activation rows (a decode step of a lightly loaded server)
// with int4 weights (groups of 32 inputs, GGUF Q4_1's scheme) or int8 weights (one scale per row).
//
// Why a kernel of our own: such a step reads every weight once, so it runs at the rate weight bytes stream
// from memory. PyTorch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` are compute-bound at one
// row and stay well short of the rate memory delivers. Here the weights are stored in the order the loop consumes
// them, one contiguous stream per thread, prefetched ahead, and the int4 inner loop is four integer dot
// instructions (`vpdpbusd`) per 128 weights, so that a step runs at about the rate memory delivers
// (docs/performance.md, "Quantized weight kernels"; benchmarks/quantized_gemv.py).
// CPUs with AVX2 but no AVX-512 (an AMD EPYC of the first Zen generation, float32 activations) get 8-lane
// loops of the same arithmetic, far faster than PyTorch's int4 kernel there. They are compute-bound on that core,
// whose 256-bit ops run as two 128-bit halves, short of the rate its memory delivers.
//
// int4 layout, per row block of 16 output rows (a float32 vector lane per row, so no horizontal sums),
// per group of 32 inputs, 320 bytes:
//     4 vectors of 64 bytes: vector c, bytes 4r..4r+3 (row r) hold inputs 8c..8c+3 of that row in their
//       low nibbles and inputs 8c+4..8c+7 in their high nibbles (q in [0, 15])
//     16 fp16 scales, 16 fp16 minimums (w = q * scale + min)
// or, where a row block's scales and minimums are per 256 inputs an fp16 factor times an 8-bit integer (Q4_K's
// are d * sc, -dmin * m with 6-bit sc and m: `pack_int4` finds such factors), the super-block layout, per row block
// and 8 groups, 2368 bytes: 16 fp16 scale factors, 16 fp16 minimum factors, per group 16 u8 scales and 16 u8
// minimums (scale = factor * u8, exact in float32), then per group the 4 vectors of nibbles, each on cache lines
// of its own as in the other layout. 4.625 bits a weight instead of
// 5: 7.5 % fewer bytes (Qwen2.5-Coder-1.5B's int4 products 670.9 -> 620.6 MB a step), and Q4_K's scales exactly
// instead of rounded to fp16. The op tells the two apart by the packed weight's size. Against the fp16 layout on
// the same Q4_K values it is faster where the weights' bytes bound a step (up to 8 tokens), about even where the
// arithmetic does (32 tokens). Its u8 bytes sit in the header, not after a group's nibbles (which would put half
// the vectors across two lines), the headers are prefetched with the stream, and the factors are read from L1, not
// held in registers (which spill at 8 tokens): without these it is slower than the fp16 layout
// (docs/performance.md, "Quantized weight kernels").
// The activations of each group become two int8 parts, x ~ step * (hi + lo / 254): `vpdpbusd` multiplies
// the unsigned nibbles by them exactly, so the only rounding is that ~16-bit split (|error| <= step / 508,
// step = max|x| / 127 over the group) and float32 sums. Or one part, x ~ step * hi: llama.cpp's Q8_0
// activations (|error| <= step / 2), half the integer work, which bounds a step of 8 or more tokens (the
// build plan chooses per model: what Q8_0 costs depends on it). The minimums' term takes x's exact sums.
// int8 layout, per row block and group of 32 inputs: 8 vectors of 64 bytes, the 16 rows' weights + 128 for 4
// inputs each (see the int8 section); the activations split as int4's, the row scales applied at the end. Or,
// for a weight the file stored as Q6_K, the int8 op's 6-bit layout (its section): the file's values at 6.625 bits
// a weight instead of re-quantized to 8 per row, the op again telling the two apart by the packed size.
// The int8 loop multiplies in integers (`vpdpbusd`) rather than widening each weight to float32 for a `vfmadd`,
// which is compute-bound from a few tokens on and slower even on streamed weights. A K-quant mix's Q6_K tensors run
// on it: 470 MB of Qwen2.5-Coder-1.5B's 1.13 GB step (docs/performance.md, "Quantized weight kernels").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "team.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LLMSERVE_GEMV_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMSERVE_GEMV_AVX2 1  // hosts without AVX-512 (AMD Zen 2/3, older Intel): 8-lane loops of their own
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRows = 16;        // output rows per row block: one float32 lane each
constexpr int64_t kGroup = 32;       // int4 inputs per scale and minimum
constexpr int64_t kInt4GroupBytes = kGroup * kRows / 2 + 2 * kRows * 2;  // nibbles, fp16 scales, fp16 mins
// The super-block layout (see the header): 8 groups share a header of fp16 factors, each group its u8 ones
constexpr int64_t kSuperGroups = 8;
constexpr int64_t kSuperFactorBytes = 2 * kRows * 2;                             // fp16 scale, min factors
constexpr int64_t kSuperHeaderBytes = kSuperFactorBytes + kSuperGroups * 2 * kRows;  // and each group's u8 ones
constexpr int64_t kSuperGroupBytes = kGroup * kRows / 2;                            // then each group's nibbles
constexpr int64_t kSuperBlockBytes = kSuperHeaderBytes + kSuperGroups * kSuperGroupBytes;  // 37 cache lines
constexpr int64_t kMaxTokens = 8;    // activation rows per pass over the weights (accumulators in registers)
// From this many tokens on, the int4 loop keeps one dependency chain per token and activation part instead
// of two (one per nibble): the tokens give the multiplier enough independent chains, and 5 accumulators a
// token spill out of the 32 vector registers past 5 tokens (docs/performance.md, "Quantized weight kernels").
constexpr int kMergeChainsFrom = 5;
// How far ahead of the loops the weight stream is prefetched, into L2 rather than L1: an L1 prefetch holds one
// of the core's few line-fill buffers until its line arrives, which caps how many misses each core keeps in
// flight (docs/performance.md, "Quantized weight kernels").
constexpr int64_t kPrefetchBytes = 8192;
// Weights a step reads once (one pass: at most kMaxTokens tokens) are prefetched non-temporally on AMD CPUs: a
// step streams 95 MB (SmolLM2) to 1.1 GB (Qwen2.5-Coder-1.5B) of them through an L3 (32 MB on the Zen 5 host)
// that, on AMD, takes every line L2 evicts, so they would push out what the step reads again (the KV cache, the
// activations, the next layer's small tensors) and slow their own stream
// (docs/performance.md, "Quantized weight kernels"). Elsewhere (Intel: NTA fills L1 only, the line-fill-buffer
// limit above; not measured) and for steps that pass over a tile more than once (it must stay in L2 between
// passes), into L2.
enum class WeightStream { kCached, kOnce };

inline WeightStream weight_stream(bool one_pass) {
  static const bool amd = __builtin_cpu_is("amd");
  return amd && one_pass ? WeightStream::kOnce : WeightStream::kCached;
}

// Prefetches the `bytes` of weight stream that lie kPrefetchBytes after `p` (each line once, a super-block's header
// included: a line skipped here is a demand miss later)
#if LLMSERVE_GEMV_AVX512 || LLMSERVE_GEMV_AVX2
inline void prefetch_ahead(const uint8_t* p, int64_t bytes, WeightStream stream) {
  const char* ahead = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  if (stream == WeightStream::kOnce) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_NTA);
  } else {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T2);
  }
}

// Moves a weight stream `p` to group g's own bytes, taking a super-block's header (`header_bytes`, 0: a layout
// without) at its first group, and prefetches
inline void enter_group(const uint8_t*& p, int64_t g, const uint8_t*& header, int64_t header_bytes,
                        int64_t group_bytes, WeightStream stream) {
  if (header_bytes && g % kSuperGroups == 0) {
    header = p;
    p += header_bytes;
    prefetch_ahead(header, header_bytes, stream);
  }
  prefetch_ahead(p, group_bytes, stream);
}
#endif

// A step of more than kMaxTokens tokens passes over each tile of row blocks once per kMaxTokens tokens; a tile
// this size stays in L2 between passes, so the weights stream from memory once, not once a pass.
constexpr int64_t kTileBytes = 256 * 1024;

// Row blocks split between torch's threads, contiguous so that each thread reads one stream; each thread
// runs `pass(first_token, tokens, block_begin, block_end, stream)` over each tile of its blocks for every
// kMaxTokens tokens. `block_bytes`: the weight bytes of one row block.
template <typename Pass>
void for_token_passes(int64_t num_blocks, int64_t m, int64_t block_bytes, const Pass& pass) {
  const bool one_pass = m <= kMaxTokens;
  const int64_t tile = one_pass ? num_blocks : std::max<int64_t>(1, kTileBytes / block_bytes);
  const WeightStream stream = weight_stream(one_pass);
  llmserve::team::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += tile) {
      const int64_t tile_end = std::min(end, b + tile);
      for (int64_t t0 = 0; t0 < m; t0 += kMaxTokens) pass(t0, std::min(kMaxTokens, m - t0), b, tile_end, stream);
    }
  });
}

// Calls kernel(std::integral_constant<int, m>{}) for 1 <= m <= M: the vector loops take the token count as
// a compile-time constant, so each token's accumulators live in registers.
template <int M, typename Kernel>
void with_token_count(int64_t m, const Kernel& kernel) {
  if constexpr (M > 1) {
    if (m < M) return with_token_count<M - 1>(m, kernel);
  }
  kernel(std::integral_constant<int, M>{});
}

template <typename T>
inline float as_float(T v) {
  return static_cast<float>(v);
}

// Stores 16 float32 results of one token's row block in the output's dtype.
template <typename T>
inline void store_rows(T* out, const float* rows) {
  for (int r = 0; r < kRows; ++r) out[r] = static_cast<T>(rows[r]);
}

void check_activations(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be a [tokens, in_features] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
}

// ---- activations, split into int8 parts (both products) ----------------------------------------------

// One pass's tokens, as the integer loops read them: per token and group of 32 inputs, int8 parts hi and lo
// with x ~ step * (hi + lo / 254) (or hi alone, x ~ step * hi), the exact sum of x (int4's minimums' term)
// and the sums of the parts themselves (int8's: its weights are stored as w + 128, see below).
struct SplitTokens {
  const int8_t* hi;  // [tokens, k]
  const int8_t* lo;  // nullptr: one part
  const float* step;  // [tokens, k / 32]
  const float* sum;
  const int32_t* hi_sum;  // [tokens, k / 16], per half group (the 6-bit layout's scales are per 16 inputs);
  const int32_t* lo_sum;  // nullptr unless asked for

  SplitTokens from(int64_t token, int64_t k) const {
    const int64_t groups = k / kGroup;
    return {hi + token * k, lo ? lo + token * k : nullptr, step + token * groups, sum + token * groups,
            hi_sum ? hi_sum + token * 2 * groups : nullptr, lo_sum ? lo_sum + token * 2 * groups : nullptr};
  }
  // the parts' sums over group tg (token * groups + g): both halves
  int32_t hi_group_sum(int64_t tg) const { return hi_sum[2 * tg] + hi_sum[2 * tg + 1]; }
  int32_t lo_group_sum(int64_t tg) const { return lo_sum[2 * tg] + lo_sum[2 * tg + 1]; }
};

#if LLMSERVE_GEMV_AVX512
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {  // bf16 is the top half of a float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
#endif

// Splits the activations; its buffers are reused across calls (one per thread that calls).
template <typename T>
SplitTokens split_activations(const T* x, int64_t m, int64_t k, bool two_parts, bool part_sums = false) {
  thread_local std::vector<int8_t> hi, lo;
  thread_local std::vector<float> step, sum;
  thread_local std::vector<int32_t> hi_sum, lo_sum;
  const int64_t groups = k / kGroup;
  hi.resize(m * k);
  lo.resize(two_parts ? m * k : 0);
  step.resize(m * groups);
  sum.resize(m * groups);
  hi_sum.resize(part_sums ? 2 * m * groups : 0);
  lo_sum.resize(part_sums && two_parts ? 2 * m * groups : 0);
  for (int64_t tg = 0; tg < m * groups; ++tg) {
#if LLMSERVE_GEMV_AVX512
    const __m512 v[2] = {load16(x + tg * kGroup), load16(x + tg * kGroup + 16)};
    const float absmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    sum[tg] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    step[tg] = absmax > 0.f ? absmax / 127.f : 1.f;
    const __m512 inv = _mm512_set1_ps(1.f / step[tg]);
    for (int half = 0; half < 2; ++half) {
      const __m512 scaled = _mm512_mul_ps(v[half], inv);
      const __m512 h = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(scaled, h), _mm512_set1_ps(254.f)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi.data() + tg * kGroup + 16 * half),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h)));
      if (two_parts)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo.data() + tg * kGroup + 16 * half),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
      if (part_sums) {  // integers, exact in float32
        hi_sum[2 * tg + half] = static_cast<int32_t>(_mm512_reduce_add_ps(h));
        if (two_parts) lo_sum[2 * tg + half] = static_cast<int32_t>(_mm512_reduce_add_ps(l));
      }
    }
#else
    const T* v = x + tg * kGroup;
    float absmax = 0.f, total = 0.f;
    for (int i = 0; i < kGroup; ++i) {
      absmax = std::max(absmax, std::fabs(as_float(v[i])));
      total += as_float(v[i]);
    }
    const float s = absmax > 0.f ? absmax / 127.f : 1.f;
    const float inv = 1.f / s;
    int32_t part_total[2][2] = {};  // [half, part]
    for (int i = 0; i < kGroup; ++i) {
      const float scaled = as_float(v[i]) * inv;
      const float h = std::nearbyint(scaled);
      hi[tg * kGroup + i] = static_cast<int8_t>(h);
      part_total[i / 16][0] += hi[tg * kGroup + i];
      if (two_parts) {
        lo[tg * kGroup + i] = static_cast<int8_t>(std::nearbyint((scaled - h) * 254.f));
        part_total[i / 16][1] += lo[tg * kGroup + i];
      }
    }
    step[tg] = s;
    sum[tg] = total;
    for (int half = 0; part_sums && half < 2; ++half) {
      hi_sum[2 * tg + half] = part_total[half][0];
      if (two_parts) lo_sum[2 * tg + half] = part_total[half][1];
    }
#endif
  }
  return {hi.data(), two_parts ? lo.data() : nullptr, step.data(), sum.data(),
          part_sums ? hi_sum.data() : nullptr, part_sums && two_parts ? lo_sum.data() : nullptr};
}

// ---- int4 -------------------------------------------------------------------------------------------

// Bytes of one row block of `groups` groups in either int4 layout
template <bool Super>
constexpr int64_t int4_block_bytes(int64_t groups) {
  return Super ? groups / kSuperGroups * kSuperBlockBytes : groups * kInt4GroupBytes;
}

template <bool Super, typename T>
void int4_rows_portable(const uint8_t* w, SplitTokens a, T* out, int64_t m, int64_t k, int64_t n, int64_t block_begin,
                        int64_t block_end) {
  const int64_t groups = k / kGroup;
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t t = 0; t < m; ++t) {
      float total[kRows] = {};
      const uint8_t* p = w + b * int4_block_bytes<Super>(groups);
      const uint8_t* header = nullptr;  // the super-block's
      for (int64_t g = 0; g < groups; ++g) {
        if (Super && g % kSuperGroups == 0) {
          header = p;
          p += kSuperHeaderBytes;
        }
        const int8_t* hi = a.hi + t * k + g * kGroup;
        const int8_t* lo = a.lo ? a.lo + t * k + g * kGroup : nullptr;
        int32_t dot_hi[kRows] = {}, dot_lo[kRows] = {};
        for (int c = 0; c < 4; ++c) {
          for (int r = 0; r < kRows; ++r) {
            for (int s = 0; s < 4; ++s) {
              const uint8_t byte = p[c * 64 + 4 * r + s];
              dot_hi[r] += (byte & 15) * hi[8 * c + s] + (byte >> 4) * hi[8 * c + 4 + s];
              if (lo) dot_lo[r] += (byte & 15) * lo[8 * c + s] + (byte >> 4) * lo[8 * c + 4 + s];
            }
          }
        }
        const float step = a.step[t * groups + g], sum = a.sum[t * groups + g];
        for (int r = 0; r < kRows; ++r) {
          float scale, minimum;
          if constexpr (Super) {
            const at::Half* factors = reinterpret_cast<const at::Half*>(header);
            const uint8_t* u = header + kSuperFactorBytes + 2 * kRows * (g % kSuperGroups);
            scale = static_cast<float>(factors[r]) * static_cast<float>(u[r]);
            minimum = static_cast<float>(factors[kRows + r]) * static_cast<float>(u[kRows + r]);
          } else {
            scale = static_cast<float>(reinterpret_cast<const at::Half*>(p + 256)[r]);
            minimum = static_cast<float>(reinterpret_cast<const at::Half*>(p + 256)[kRows + r]);
          }
          const float dot = static_cast<float>(dot_hi[r]) + static_cast<float>(dot_lo[r]) * (1.f / 254.f);
          total[r] += dot * (scale * step) + minimum * sum;
        }
        p += Super ? kSuperGroupBytes : kInt4GroupBytes;
      }
      store_rows(out + t * n + b * kRows, total);
    }
  }
}

#if LLMSERVE_GEMV_AVX512
// Per 64 weight bytes (16 rows x 8 inputs; a row's 4 bytes are one int32 lane): low nibbles times
// inputs 8c..8c+3, high nibbles times 8c+4..8c+7, for each token's hi and lo part: four `vpdpbusd`
// (two with one part).
template <int M, int Parts, bool Super, typename T>
void int4_rows_avx512(const uint8_t* w, SplitTokens a, T* out, int64_t k, int64_t n, int64_t block_begin,
                      int64_t block_end, WeightStream stream) {
  const int64_t groups = k / kGroup;
  const __m512i nibble = _mm512_set1_epi8(15);
  const __m512 lo_weight = _mm512_set1_ps(1.f / 254.f);
  const uint8_t* p = w + block_begin * int4_block_bytes<Super>(groups);
  for (int64_t b = block_begin; b < block_end; ++b) {
    __m512 total[M];
    for (int t = 0; t < M; ++t) total[t] = _mm512_setzero_ps();
    const uint8_t* header = nullptr;  // the super-block's (read from L1 per group: registers are few at 8 tokens)
    for (int64_t g = 0; g < groups; ++g, p += Super ? kSuperGroupBytes : kInt4GroupBytes) {
      enter_group(p, g, header, Super ? kSuperHeaderBytes : 0, Super ? kSuperGroupBytes : kInt4GroupBytes, stream);
      // [low nibbles, high nibbles]: independent dependency chains (one for both past kMergeChainsFrom tokens
      // of two parts; one part keeps two chains a token, as many accumulators as two parts' merged chains)
      constexpr int S = Parts == 2 && M >= kMergeChainsFrom ? 1 : 2;
      __m512i dot_hi[M][S], dot_lo[M][S];
      for (int t = 0; t < M; ++t) {
        for (int s = 0; s < S; ++s) dot_hi[t][s] = dot_lo[t][s] = _mm512_setzero_si512();
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i bytes = _mm512_loadu_si512(p + c * 64);
        const __m512i low = _mm512_and_si512(bytes, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        for (int t = 0; t < M; ++t) {
          const int32_t* hi = reinterpret_cast<const int32_t*>(a.hi + t * k + g * kGroup + 8 * c);
          const int32_t* lo = reinterpret_cast<const int32_t*>(Parts == 2 ? a.lo + t * k + g * kGroup + 8 * c : nullptr);
          dot_hi[t][0] = _mm512_dpbusd_epi32(dot_hi[t][0], low, _mm512_set1_epi32(hi[0]));
          dot_hi[t][S - 1] = _mm512_dpbusd_epi32(dot_hi[t][S - 1], high, _mm512_set1_epi32(hi[1]));
          if constexpr (Parts == 2) {
            dot_lo[t][0] = _mm512_dpbusd_epi32(dot_lo[t][0], low, _mm512_set1_epi32(lo[0]));
            dot_lo[t][S - 1] = _mm512_dpbusd_epi32(dot_lo[t][S - 1], high, _mm512_set1_epi32(lo[1]));
          }
        }
      }
      __m512 scales, mins;
      if constexpr (Super) {  // factor x u8, exact in float32
        const __m256i* factors = reinterpret_cast<const __m256i*>(header);
        const __m128i* u = reinterpret_cast<const __m128i*>(header + kSuperFactorBytes) + 2 * (g % kSuperGroups);
        scales = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(factors)),
                               _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(u))));
        mins = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(factors + 1)),
                             _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(u + 1))));
      } else {
        scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
        mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
      }
      for (int t = 0; t < M; ++t) {
        const __m512 dot_h = _mm512_cvtepi32_ps(S == 1 ? dot_hi[t][0] : _mm512_add_epi32(dot_hi[t][0], dot_hi[t][S - 1]));
        __m512 dot = dot_h;
        if constexpr (Parts == 2) {
          const __m512 dot_l = _mm512_cvtepi32_ps(S == 1 ? dot_lo[t][0] : _mm512_add_epi32(dot_lo[t][0], dot_lo[t][S - 1]));
          dot = _mm512_fmadd_ps(dot_l, lo_weight, dot_h);
        }
        const __m512 scale = _mm512_mul_ps(scales, _mm512_set1_ps(a.step[t * groups + g]));
        total[t] = _mm512_fmadd_ps(dot, scale, total[t]);
        total[t] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.sum[t * groups + g]), total[t]);
      }
    }
    alignas(64) float rows[kRows];
    for (int t = 0; t < M; ++t) {
      _mm512_store_ps(rows, total[t]);
      store_rows(out + t * n + b * kRows, rows);
    }
  }
}
#endif

#if LLMSERVE_GEMV_AVX2
// AVX2 has no `vpdpbusd`: `vpmaddubsw` multiplies the unsigned nibbles by an int8 part and adds pairs into
// int16 (a pair is at most 2 * 15 * 127 = 3810 in size, and a group's eight of them, 30480, still fit), and one
// `vpmaddwd` by ones a group widens them to the int32 row sums. The integer dot products are the AVX-512
// loop's, exactly, and so is the float32 arithmetic after them. A 256-bit vector holds 8 rows: each row
// block is two halves, bytes 0-31 (rows 0-7) and 32-63 (rows 8-15) of every 64-byte vector.
template <int M, int Parts, bool Super, typename T>
void int4_rows_avx2(const uint8_t* w, SplitTokens a, T* out, int64_t k, int64_t n, int64_t block_begin,
                    int64_t block_end, WeightStream stream) {
  const int64_t groups = k / kGroup;
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 lo_weight = _mm256_set1_ps(1.f / 254.f);
  const uint8_t* p = w + block_begin * int4_block_bytes<Super>(groups);
  for (int64_t b = block_begin; b < block_end; ++b) {
    __m256 total[M][2];
    for (int t = 0; t < M; ++t) total[t][0] = total[t][1] = _mm256_setzero_ps();
    const uint8_t* header = nullptr;  // the super-block's
    for (int64_t g = 0; g < groups; ++g, p += Super ? kSuperGroupBytes : kInt4GroupBytes) {
      enter_group(p, g, header, Super ? kSuperHeaderBytes : 0, Super ? kSuperGroupBytes : kInt4GroupBytes, stream);
      for (int half = 0; half < 2; ++half) {
        const uint8_t* bytes = p + 32 * half;
        __m256 scales, mins;
        if constexpr (Super) {  // factor x u8, exact in float32
          const uint8_t* u = header + kSuperFactorBytes + 2 * kRows * (g % kSuperGroups);
          const auto u8 = [&](int offset) {
            return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + offset))));
          };
          const auto factor = [&](int offset) {
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + offset)));
          };
          scales = _mm256_mul_ps(factor(16 * half), u8(8 * half));
          mins = _mm256_mul_ps(factor(32 + 16 * half), u8(kRows + 8 * half));
        } else {
          scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 256 + 16 * half)));
          mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 288 + 16 * half)));
        }
        for (int t = 0; t < M; ++t) {
          // the nibbles are unpacked again for each token (from L1): holding all eight in registers spilled
          const int32_t* hi = reinterpret_cast<const int32_t*>(a.hi + t * k + g * kGroup);
          const int32_t* lo = reinterpret_cast<const int32_t*>(Parts == 2 ? a.lo + t * k + g * kGroup : nullptr);
          __m256i sum_hi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // [low, high nibbles]
          __m256i sum_lo[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + c * 64));
            const __m256i low = _mm256_and_si256(packed, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            sum_hi[0] = _mm256_add_epi16(sum_hi[0], _mm256_maddubs_epi16(low, _mm256_set1_epi32(hi[2 * c])));
            sum_hi[1] = _mm256_add_epi16(sum_hi[1], _mm256_maddubs_epi16(high, _mm256_set1_epi32(hi[2 * c + 1])));
            if constexpr (Parts == 2) {
              sum_lo[0] = _mm256_add_epi16(sum_lo[0], _mm256_maddubs_epi16(low, _mm256_set1_epi32(lo[2 * c])));
              sum_lo[1] = _mm256_add_epi16(sum_lo[1], _mm256_maddubs_epi16(high, _mm256_set1_epi32(lo[2 * c + 1])));
            }
          }
          const __m256 dot_h = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(sum_hi[0], sum_hi[1]), ones));
          __m256 dot = dot_h;
          if constexpr (Parts == 2) {
            const __m256 dot_l = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(sum_lo[0], sum_lo[1]), ones));
            dot = _mm256_fmadd_ps(dot_l, lo_weight, dot_h);
          }
          const __m256 scale = _mm256_mul_ps(scales, _mm256_set1_ps(a.step[t * groups + g]));
          total[t][half] = _mm256_fmadd_ps(dot, scale, total[t][half]);
          total[t][half] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.sum[t * groups + g]), total[t][half]);
        }
      }
    }
    alignas(32) float rows[kRows];
    for (int t = 0; t < M; ++t) {
      _mm256_store_ps(rows, total[t][0]);
      _mm256_store_ps(rows + 8, total[t][1]);
      store_rows(out + t * n + b * kRows, rows);
    }
  }
}
#endif

template <int Parts, bool Super, typename T>
void int4_product(const at::Tensor& x, const uint8_t* w, at::Tensor& out, bool portable) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), num_blocks = n / kRows;
  const SplitTokens a = split_activations(x.data_ptr<T>(), m, k, Parts == 2);
  T* o = out.data_ptr<T>();
  if (portable) return int4_rows_portable<Super>(w, a, o, m, k, n, 0, num_blocks);
  for_token_passes(num_blocks, m, int4_block_bytes<Super>(k / kGroup), [&](int64_t t0, int64_t mt, int64_t begin,
                                                                           int64_t end,
                                                                           [[maybe_unused]] WeightStream stream) {
#if LLMSERVE_GEMV_AVX512
    with_token_count<kMaxTokens>(mt, [&](auto tokens) {
      int4_rows_avx512<decltype(tokens)::value, Parts, Super>(w, a.from(t0, k), o + t0 * n, k, n, begin, end, stream);
    });
#elif LLMSERVE_GEMV_AVX2
    with_token_count<kMaxTokens>(mt, [&](auto tokens) {
      int4_rows_avx2<decltype(tokens)::value, Parts, Super>(w, a.from(t0, k), o + t0 * n, k, n, begin, end, stream);
    });
#else
    int4_rows_portable<Super>(w, a.from(t0, k), o + t0 * n, mt, k, n, begin, end);
#endif
  });
}

template <bool Super>
void int4_dispatch(const at::Tensor& x, const uint8_t* w, at::Tensor& out, int64_t activation_parts, bool portable) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (activation_parts == 2) {
    bf16 ? int4_product<2, Super, at::BFloat16>(x, w, out, portable) : int4_product<2, Super, float>(x, w, out, portable);
  } else {
    bf16 ? int4_product<1, Super, at::BFloat16>(x, w, out, portable) : int4_product<1, Super, float>(x, w, out, portable);
  }
}

// `out`: [tokens, out_features] in x's dtype, contiguous (its width is the product's out_features)
void check_output(const at::Tensor& x, const at::Tensor& out, const char* op) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              op, ": out must be a contiguous [tokens, out_features] tensor in x's dtype");
}

void int4_gemv_into(const at::Tensor& x_in, const at::Tensor& packed, int64_t activation_parts, at::Tensor& out,
                    bool portable) {
  check_activations(x_in, "int4_gemv");
  TORCH_CHECK(activation_parts == 1 || activation_parts == 2, "int4_gemv: activation_parts must be 1 or 2");
  check_output(x_in, out, "int4_gemv");
  const int64_t n = out.size(1);
  const at::Tensor x = x_in.contiguous();
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kGroup == 0 && n % kRows == 0, "int4_gemv: in_features must be a multiple of 32 and "
              "out_features of 16");
  // the layout is the one whose size the packed weight has (they differ for every shape both fit)
  const int64_t groups = k / kGroup, num_blocks = n / kRows;
  const bool super = groups % kSuperGroups == 0 && packed.numel() == num_blocks * int4_block_bytes<true>(groups);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              (super || packed.numel() == num_blocks * int4_block_bytes<false>(groups)),
              "int4_gemv: packed weight does not match [", n, ", ", k, "]");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  super ? int4_dispatch<true>(x, w, out, activation_parts, portable)
        : int4_dispatch<false>(x, w, out, activation_parts, portable);
}

at::Tensor int4_gemv_impl(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t activation_parts,
                          bool portable) {
  check_activations(x, "int4_gemv");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  int4_gemv_into(x, packed, activation_parts, out, portable);
  return out;
}

// x [tokens, k] times the int4 weight packed by `pack_int4` (kernels/quantized_gemv.py): [tokens, n].
// `activation_parts`: 2 (x to ~16 bits) or 1 (x as Q8_0: an int8 per input, a scale per 32).
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t activation_parts) {
  return int4_gemv_impl(x, packed, n, activation_parts, false);
}

// The same product through the portable loop, single-threaded: what the vector path is tested against.
at::Tensor int4_gemv_portable(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t activation_parts) {
  return int4_gemv_impl(x, packed, n, activation_parts, true);
}

// ---- int8 -------------------------------------------------------------------------------------------

// The int8 weight, per row block, per group of 32 inputs: 8 vectors of 64 bytes, vector c's bytes 4r..4r+3
// holding inputs 4c..4c+3 of row r as u = w + 128: `vpdpbusd` multiplies unsigned bytes by signed ones, so
// the weights take the unsigned side and the activations' parts (as int4's) the signed one, and the 128
// comes back out per token and group in integers, sum(u x) - 128 sum(x): each group's dot product is exact.
// The row scales are applied once, at the end.
constexpr int64_t kInt8GroupBytes = kGroup * kRows;
// The grouped layout: where a weight is stored as Q8_0 (w = d q, q in [-127, 127]) or Q5_0 (w = d (q - 16), q in
// [0, 31]), an fp16 d per 32 inputs, the int8 op reads q (as q - 16 for Q5_0) in the bytes above, each group's 16
// rows' d (fp16) after them (`pack_int8_grouped`): 8.5 bits a weight, the file's values exactly, where per row they
// were re-quantized (or, unquantized, read as 16-bit values: twice the bytes). The integer dot products are the
// per-row layout's; each group's d multiplies its step, as the 6-bit layout's d does, and the row scales are ones.
constexpr int64_t kInt8GroupedBytes = kInt8GroupBytes + kRows * 2;

template <bool Grouped>
constexpr int64_t int8_group_bytes() {
  return Grouped ? kInt8GroupedBytes : kInt8GroupBytes;
}

template <bool Grouped, typename T>
void int8_rows_portable(const uint8_t* w, SplitTokens a, const float* scales, T* out, int64_t m, int64_t k,
                        int64_t n, int64_t block_begin, int64_t block_end) {
  const int64_t groups = k / kGroup;
  constexpr int64_t group_bytes = int8_group_bytes<Grouped>();
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t t = 0; t < m; ++t) {
      float total[kRows] = {};
      const uint8_t* p = w + b * groups * group_bytes;
      for (int64_t g = 0; g < groups; ++g, p += group_bytes) {
        const int8_t* hi = a.hi + t * k + g * kGroup;
        const int8_t* lo = a.lo ? a.lo + t * k + g * kGroup : nullptr;
        int32_t dot_hi[kRows] = {}, dot_lo[kRows] = {};
        for (int c = 0; c < 8; ++c) {
          for (int r = 0; r < kRows; ++r) {
            for (int s = 0; s < 4; ++s) {
              const int32_t u = p[c * 64 + 4 * r + s];
              dot_hi[r] += u * hi[4 * c + s];
              if (lo) dot_lo[r] += u * lo[4 * c + s];
            }
          }
        }
        const int64_t tg = t * groups + g;
        const int32_t hi_offset = 128 * a.hi_group_sum(tg), lo_offset = lo ? 128 * a.lo_group_sum(tg) : 0;
        for (int r = 0; r < kRows; ++r) {
          const float dot = static_cast<float>(dot_hi[r] - hi_offset) +
                            static_cast<float>(dot_lo[r] - lo_offset) * (1.f / 254.f);
          if constexpr (Grouped) {
            const float d = static_cast<float>(reinterpret_cast<const at::Half*>(p + kInt8GroupBytes)[r]);
            total[r] += dot * (d * a.step[tg]);
          } else {
            total[r] += dot * a.step[tg];
          }
        }
      }
      for (int r = 0; r < kRows; ++r) total[r] *= scales[b * kRows + r];
      store_rows(out + t * n + b * kRows, total);
    }
  }
}

#if LLMSERVE_GEMV_AVX512
// Per 64 weight bytes (16 rows x 4 inputs): one `vpdpbusd` per token and part, spread over at least eight
// dependency chains (a token and part's own vectors alternate between 8 / (tokens x parts) of them).
template <int M, int Parts, bool Grouped, typename T>
void int8_rows_avx512(const uint8_t* w, SplitTokens a, const float* scales, T* out, int64_t k, int64_t n,
                      int64_t block_begin, int64_t block_end, WeightStream stream) {
  const int64_t groups = k / kGroup;
  constexpr int64_t group_bytes = int8_group_bytes<Grouped>();
  constexpr int S = M * Parts >= 8 ? 1 : 8 / (M * Parts);
  const __m512 lo_weight = _mm512_set1_ps(1.f / 254.f);
  const uint8_t* p = w + block_begin * groups * group_bytes;
  for (int64_t b = block_begin; b < block_end; ++b) {
    __m512 total[M];
    for (int t = 0; t < M; ++t) total[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, p += group_bytes) {
      prefetch_ahead(p, group_bytes, stream);
      __m512i dot_hi[M][S], dot_lo[M][S];
      for (int t = 0; t < M; ++t) {
        for (int s = 0; s < S; ++s) dot_hi[t][s] = dot_lo[t][s] = _mm512_setzero_si512();
      }
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i u = _mm512_loadu_si512(p + c * 64);
        for (int t = 0; t < M; ++t) {
          const int32_t* hi = reinterpret_cast<const int32_t*>(a.hi + t * k + g * kGroup);
          dot_hi[t][c % S] = _mm512_dpbusd_epi32(dot_hi[t][c % S], u, _mm512_set1_epi32(hi[c]));
          if constexpr (Parts == 2) {
            const int32_t* lo = reinterpret_cast<const int32_t*>(a.lo + t * k + g * kGroup);
            dot_lo[t][c % S] = _mm512_dpbusd_epi32(dot_lo[t][c % S], u, _mm512_set1_epi32(lo[c]));
          }
        }
      }
      for (int t = 0; t < M; ++t) {
        const int64_t tg = t * groups + g;
        __m512i h = dot_hi[t][0], l = dot_lo[t][0];
        for (int c = 1; c < S; ++c) {
          h = _mm512_add_epi32(h, dot_hi[t][c]);
          if constexpr (Parts == 2) l = _mm512_add_epi32(l, dot_lo[t][c]);
        }
        __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(h, _mm512_set1_epi32(128 * a.hi_group_sum(tg))));
        if constexpr (Parts == 2) {
          dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(l, _mm512_set1_epi32(128 * a.lo_group_sum(tg)))),
                                lo_weight, dot);
        }
        if constexpr (Grouped) {
          const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kInt8GroupBytes)));
          total[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a.step[tg])), total[t]);
        } else {
          total[t] = _mm512_fmadd_ps(dot, _mm512_set1_ps(a.step[tg]), total[t]);
        }
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + b * kRows);
    alignas(64) float rows[kRows];
    for (int t = 0; t < M; ++t) {
      _mm512_store_ps(rows, _mm512_mul_ps(total[t], s));
      store_rows(out + t * n + b * kRows, rows);
    }
  }
}
#endif

#if LLMSERVE_GEMV_AVX2
// No `vpdpbusd`, and `vpmaddubsw`'s int16 pair sums would overflow on bytes up to 255: the weights widen to
// int16 and `vpmaddwd` multiplies them by the token's inputs as int16, hi (one part) or 254 hi + lo (two
// parts; at most 32385 in size, exact), summing pairs into int32. A 128-bit load is 4 rows x 4 inputs, so
// each row gets two int32 lanes; one `vphaddd` a group adds them, leaving the rows in the order
// 0 1 4 5 2 3 6 7 (`kHaddOrder`), put back once per row block. Integer sums exact, as the AVX-512 loop's.
template <int M, int Parts, bool Grouped, typename T>
void int8_rows_avx2(const uint8_t* w, SplitTokens a, const float* scales, T* out, int64_t k, int64_t n,
                    int64_t block_begin, int64_t block_end, WeightStream stream) {
  const int64_t groups = k / kGroup;
  constexpr int64_t group_bytes = int8_group_bytes<Grouped>();
  const __m256i hadd_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  const uint8_t* p = w + block_begin * groups * group_bytes;
  for (int64_t b = block_begin; b < block_end; ++b) {
    __m256 total[M][2];
    for (int t = 0; t < M; ++t) total[t][0] = total[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, p += group_bytes) {
      prefetch_ahead(p, group_bytes, stream);
      for (int t = 0; t < M; ++t) {
        const int64_t tg = t * groups + g;
        alignas(32) int16_t x[kGroup];
        for (int i = 0; i < kGroup; ++i)
          x[i] = static_cast<int16_t>(Parts == 2 ? 254 * a.hi[t * k + g * kGroup + i] + a.lo[t * k + g * kGroup + i]
                                                 : a.hi[t * k + g * kGroup + i]);
        const int32_t offset = 128 * (Parts == 2 ? 254 * a.hi_group_sum(tg) + a.lo_group_sum(tg) : a.hi_group_sum(tg));
        const __m256 step = _mm256_set1_ps(Parts == 2 ? a.step[tg] * (1.f / 254.f) : a.step[tg]);
        for (int half = 0; half < 2; ++half) {
          __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // rows 0-3, 4-7 of the half
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) {
            const __m128i* bytes = reinterpret_cast<const __m128i*>(p + c * 64 + 32 * half);
            const __m256i xv = _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + 4 * c)));
            dot[0] = _mm256_add_epi32(dot[0], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(bytes)), xv));
            dot[1] = _mm256_add_epi32(dot[1], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(bytes + 1)), xv));
          }
          const __m256i rows = _mm256_sub_epi32(_mm256_hadd_epi32(dot[0], dot[1]), _mm256_set1_epi32(offset));
          if constexpr (Grouped) {  // the half's 8 d, in the rows' order here (the order is its own inverse)
            const __m256 d = _mm256_permutevar8x32_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kInt8GroupBytes + 16 * half))),
                hadd_order);
            total[t][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), _mm256_mul_ps(d, step), total[t][half]);
          } else {
            total[t][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), step, total[t][half]);
          }
        }
      }
    }
    const __m256 s0 = _mm256_loadu_ps(scales + b * kRows), s1 = _mm256_loadu_ps(scales + b * kRows + 8);
    alignas(32) float rows[kRows];
    for (int t = 0; t < M; ++t) {
      _mm256_store_ps(rows, _mm256_mul_ps(_mm256_permutevar8x32_ps(total[t][0], hadd_order), s0));
      _mm256_store_ps(rows + 8, _mm256_mul_ps(_mm256_permutevar8x32_ps(total[t][1], hadd_order), s1));
      store_rows(out + t * n + b * kRows, rows);
    }
  }
}
#endif

// ---- the int8 op's 6-bit layout (GGUF Q6_K's values, exactly) ----------------------------------------

// Where a weight is stored as Q6_K (w = d * sc * (q - 32): q in [0, 63] per input, an int8 sc per 16 inputs,
// an fp16 d per 256; llama.cpp's Q4_K_M puts the output head and half the ffn_down there), the int8 op reads it
// in 6.625 bits a weight instead of re-quantized to 8 (`pack_int6`), per row block and super-block of 256
// inputs, 3392 bytes (53 cache lines):
//     a header of 320 bytes: the 16 rows' d as float32, then per group of 32 inputs 16 int8 sc of its first
//       16 inputs and 16 of its last 16 (the rows in turn)
//     per group, 384 bytes: q's low 4 bits as 4 vectors of nibbles in the int4 layout's order (vector c,
//       bytes 4r..4r+3: inputs 8c..8c+3 in the low nibbles, 8c+4..8c+7 in the high ones), then q's top 2
//       bits as 2 vectors: the nibble vector c's low (h = 0) or high (h = 1) half has its 2 bits in vector
//       c / 2, bits 2 (2 (c % 2) + h) and up, at the same byte
// `vpdpbusd` multiplies q (unsigned, 6 bits) by the activations' int8 parts per half group of 16 inputs; the
// 32 comes off as 32 times the parts' sums over those 16 (`split_activations`), and each half's sc multiplies
// its sum, all in integers (at most 2 x 128 x 16 x 32 x 127 < 2^24 in size: exact as float32 too); then, as the
// int4 loops do, d times the group's step. The row scales (ones for such a weight) are applied at the end as
// int8's.
constexpr int64_t kInt6HeaderBytes = kRows * 4 + kSuperGroups * 2 * kRows;  // float32 d, int8 sc
constexpr int64_t kInt6GroupBytes = kGroup * kRows / 2 + kGroup * kRows / 4;  // nibbles, top bits
constexpr int64_t kInt6BlockBytes = kInt6HeaderBytes + kSuperGroups * kInt6GroupBytes;
constexpr int64_t kInt6SuperInputs = kSuperGroups * kGroup;

template <typename T>
void int6_rows_portable(const uint8_t* w, SplitTokens a, const float* scales, T* out, int64_t m, int64_t k,
                        int64_t n, int64_t block_begin, int64_t block_end) {
  const int64_t groups = k / kGroup;
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t t = 0; t < m; ++t) {
      float total[kRows] = {};
      const uint8_t* p = w + b * (k / kInt6SuperInputs) * kInt6BlockBytes;
      const uint8_t* header = nullptr;
      for (int64_t g = 0; g < groups; ++g, p += kInt6GroupBytes) {
        if (g % kSuperGroups == 0) {
          header = p;
          p += kInt6HeaderBytes;
        }
        const float* d = reinterpret_cast<const float*>(header);
        const int8_t* sc = reinterpret_cast<const int8_t*>(header + kRows * 4 + 2 * kRows * (g % kSuperGroups));
        const int8_t* hi = a.hi + t * k + g * kGroup;
        const int8_t* lo = a.lo ? a.lo + t * k + g * kGroup : nullptr;
        int32_t dot_hi[2][kRows] = {}, dot_lo[2][kRows] = {};  // [half group, row]
        for (int c = 0; c < 4; ++c) {
          for (int h = 0; h < 2; ++h) {
            for (int r = 0; r < kRows; ++r) {
              for (int s = 0; s < 4; ++s) {
                const int input = 8 * c + 4 * h + s;
                const int top = (p[256 + 64 * (c / 2) + 4 * r + s] >> (2 * (2 * (c % 2) + h))) & 3;
                const int32_t q = ((p[c * 64 + 4 * r + s] >> (4 * h)) & 15) | (top << 4);
                dot_hi[c / 2][r] += q * hi[input];
                if (lo) dot_lo[c / 2][r] += q * lo[input];
              }
            }
          }
        }
        const int64_t tg = t * groups + g;
        for (int r = 0; r < kRows; ++r) {
          int32_t sum_hi = 0, sum_lo = 0;  // sc times the half groups' sums of (q - 32) x, in integers
          for (int half = 0; half < 2; ++half) {
            sum_hi += sc[kRows * half + r] * (dot_hi[half][r] - 32 * a.hi_sum[2 * tg + half]);
            if (lo) sum_lo += sc[kRows * half + r] * (dot_lo[half][r] - 32 * a.lo_sum[2 * tg + half]);
          }
          const float dot = static_cast<float>(sum_hi) + static_cast<float>(sum_lo) * (1.f / 254.f);
          total[r] += dot * (d[r] * a.step[tg]);
        }
      }
      for (int r = 0; r < kRows; ++r) total[r] *= scales[b * kRows + r];
      store_rows(out + t * n + b * kRows, total);
    }
  }
}

#if LLMSERVE_GEMV_AVX512
// q's top 2 bits for the nibble vector with `slot` = 2 (c % 2) + h, moved to bits 4-5 of each byte (16-bit
// shifts: the mask drops what crosses from the neighbouring byte). `slot` is a constant once the loops unroll.
inline __m512i top_bits512(__m512i v, int slot) {
  const __m512i moved = slot == 0 ? _mm512_slli_epi16(v, 4) : slot == 1 ? _mm512_slli_epi16(v, 2)
                        : slot == 2 ? v : _mm512_srli_epi16(v, 2);
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
}

// Per half group (two nibble vectors and their top bits): per token and part one dependency chain, or two
// (low and high nibbles) where tokens and parts are few, starting from -32 times the inputs' sum and multiplied
// by the half's sc at its end; the group's two halves then go to float32 once, times d and the step.
template <int M, int Parts, typename T>
void int6_rows_avx512(const uint8_t* w, SplitTokens a, const float* scales, T* out, int64_t k, int64_t n,
                      int64_t block_begin, int64_t block_end, WeightStream stream) {
  const int64_t groups = k / kGroup;
  constexpr int S = M * Parts >= 4 ? 1 : 2;
  const __m512i nibble = _mm512_set1_epi8(15);
  const __m512 lo_weight = _mm512_set1_ps(1.f / 254.f);
  const uint8_t* p = w + block_begin * (k / kInt6SuperInputs) * kInt6BlockBytes;
  for (int64_t b = block_begin; b < block_end; ++b) {
    __m512 total[M];
    for (int t = 0; t < M; ++t) total[t] = _mm512_setzero_ps();
    const uint8_t* header = nullptr;
    for (int64_t g = 0; g < groups; ++g, p += kInt6GroupBytes) {
      enter_group(p, g, header, kInt6HeaderBytes, kInt6GroupBytes, stream);
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
      const int8_t* sc = reinterpret_cast<const int8_t*>(header + kRows * 4 + 2 * kRows * (g % kSuperGroups));
      __m512i sum_hi[M], sum_lo[M];  // per token and part: sc times the half groups' sums of (q - 32) x
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m512i dot_hi[M][S], dot_lo[M][S];  // starting from the -32 * sum(x) of q - 32
        for (int t = 0; t < M; ++t) {
          const int64_t th = 2 * (t * groups + g) + half;
          for (int s = 0; s < S; ++s) {
            dot_hi[t][s] = s == 0 ? _mm512_set1_epi32(-32 * a.hi_sum[th]) : _mm512_setzero_si512();
            dot_lo[t][s] = s == 0 && Parts == 2 ? _mm512_set1_epi32(-32 * a.lo_sum[th]) : _mm512_setzero_si512();
          }
        }
        const __m512i top = _mm512_loadu_si512(p + 256 + 64 * half);
#pragma GCC unroll 2
        for (int cc = 0; cc < 2; ++cc) {
          const int c = 2 * half + cc;
          const __m512i bytes = _mm512_loadu_si512(p + c * 64);
          const __m512i low = _mm512_or_si512(_mm512_and_si512(bytes, nibble), top_bits512(top, 2 * cc));
          const __m512i high = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble),
                                               top_bits512(top, 2 * cc + 1));
          for (int t = 0; t < M; ++t) {
            const int32_t* hi = reinterpret_cast<const int32_t*>(a.hi + t * k + g * kGroup + 8 * c);
            dot_hi[t][0] = _mm512_dpbusd_epi32(dot_hi[t][0], low, _mm512_set1_epi32(hi[0]));
            dot_hi[t][S - 1] = _mm512_dpbusd_epi32(dot_hi[t][S - 1], high, _mm512_set1_epi32(hi[1]));
            if constexpr (Parts == 2) {
              const int32_t* lo = reinterpret_cast<const int32_t*>(a.lo + t * k + g * kGroup + 8 * c);
              dot_lo[t][0] = _mm512_dpbusd_epi32(dot_lo[t][0], low, _mm512_set1_epi32(lo[0]));
              dot_lo[t][S - 1] = _mm512_dpbusd_epi32(dot_lo[t][S - 1], high, _mm512_set1_epi32(lo[1]));
            }
          }
        }
        const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + kRows * half)));
        for (int t = 0; t < M; ++t) {
          const __m512i h = S == 1 ? dot_hi[t][0] : _mm512_add_epi32(dot_hi[t][0], dot_hi[t][S - 1]);
          const __m512i scaled_hi = _mm512_mullo_epi32(h, scale);
          sum_hi[t] = half == 0 ? scaled_hi : _mm512_add_epi32(sum_hi[t], scaled_hi);
          if constexpr (Parts == 2) {
            const __m512i l = S == 1 ? dot_lo[t][0] : _mm512_add_epi32(dot_lo[t][0], dot_lo[t][S - 1]);
            const __m512i scaled_lo = _mm512_mullo_epi32(l, scale);
            sum_lo[t] = half == 0 ? scaled_lo : _mm512_add_epi32(sum_lo[t], scaled_lo);
          }
        }
      }
      for (int t = 0; t < M; ++t) {  // then as int4's: one rounding order whatever the token count
        __m512 dot = _mm512_cvtepi32_ps(sum_hi[t]);
        if constexpr (Parts == 2) dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_lo[t]), lo_weight, dot);
        total[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a.step[t * groups + g])), total[t]);
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + b * kRows);
    alignas(64) float rows[kRows];
    for (int t = 0; t < M; ++t) {
      _mm512_store_ps(rows, _mm512_mul_ps(total[t], s));
      store_rows(out + t * n + b * kRows, rows);
    }
  }
}
#endif

#if LLMSERVE_GEMV_AVX2
inline __m256i top_bits256(__m256i v, int slot) {  // as top_bits512
  const __m256i moved = slot == 0 ? _mm256_slli_epi16(v, 4) : slot == 1 ? _mm256_slli_epi16(v, 2)
                        : slot == 2 ? v : _mm256_srli_epi16(v, 2);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}

// `vpmaddubsw` pairs of 6-bit q and an int8 part are at most 2 * 63 * 127 = 16002 in size: two nibble vectors'
// pairs add in int16 (32004), then `vpmaddwd` by ones widens them; per half group two such sums. 8 rows a
// 256-bit vector, two halves a row block, as int4's AVX2 loop.
template <int M, int Parts, typename T>
void int6_rows_avx2(const uint8_t* w, SplitTokens a, const float* scales, T* out, int64_t k, int64_t n,
                    int64_t block_begin, int64_t block_end, WeightStream stream) {
  const int64_t groups = k / kGroup;
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 lo_weight = _mm256_set1_ps(1.f / 254.f);
  const uint8_t* p = w + block_begin * (k / kInt6SuperInputs) * kInt6BlockBytes;
  for (int64_t b = block_begin; b < block_end; ++b) {
    __m256 total[M][2];
    for (int t = 0; t < M; ++t) total[t][0] = total[t][1] = _mm256_setzero_ps();
    const uint8_t* header = nullptr;
    for (int64_t g = 0; g < groups; ++g, p += kInt6GroupBytes) {
      enter_group(p, g, header, kInt6HeaderBytes, kInt6GroupBytes, stream);
      const int8_t* sc = reinterpret_cast<const int8_t*>(header + kRows * 4 + 2 * kRows * (g % kSuperGroups));
      for (int eight = 0; eight < 2; ++eight) {  // rows 0-7, 8-15: bytes 0-31, 32-63 of each vector
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(header) + 8 * eight);
        __m256i sum_hi[M], sum_lo[M];  // as the AVX-512 loop's
        for (int half = 0; half < 2; ++half) {
          const __m256i scale = _mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + kRows * half + 8 * eight)));
          const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 + 64 * half + 32 * eight));
          for (int t = 0; t < M; ++t) {
            const int32_t* hi = reinterpret_cast<const int32_t*>(a.hi + t * k + g * kGroup);
            const int32_t* lo = reinterpret_cast<const int32_t*>(Parts == 2 ? a.lo + t * k + g * kGroup : nullptr);
            const int64_t th = 2 * (t * groups + g) + half;
            // starting from the -32 * sum(x) of q - 32, as the AVX-512 loop's
            __m256i dot_hi = _mm256_set1_epi32(-32 * a.hi_sum[th]);
            __m256i dot_lo = Parts == 2 ? _mm256_set1_epi32(-32 * a.lo_sum[th]) : _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int cc = 0; cc < 2; ++cc) {
              const int c = 2 * half + cc;
              const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + c * 64 + 32 * eight));
              const __m256i low = _mm256_or_si256(_mm256_and_si256(packed, nibble), top_bits256(top, 2 * cc));
              const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble),
                                                   top_bits256(top, 2 * cc + 1));
              dot_hi = _mm256_add_epi32(dot_hi, _mm256_madd_epi16(_mm256_add_epi16(
                  _mm256_maddubs_epi16(low, _mm256_set1_epi32(hi[2 * c])),
                  _mm256_maddubs_epi16(high, _mm256_set1_epi32(hi[2 * c + 1]))), ones));
              if constexpr (Parts == 2) {
                dot_lo = _mm256_add_epi32(dot_lo, _mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(low, _mm256_set1_epi32(lo[2 * c])),
                    _mm256_maddubs_epi16(high, _mm256_set1_epi32(lo[2 * c + 1]))), ones));
              }
            }
            const __m256i scaled_hi = _mm256_mullo_epi32(dot_hi, scale);
            sum_hi[t] = half == 0 ? scaled_hi : _mm256_add_epi32(sum_hi[t], scaled_hi);
            if constexpr (Parts == 2) {
              const __m256i scaled_lo = _mm256_mullo_epi32(dot_lo, scale);
              sum_lo[t] = half == 0 ? scaled_lo : _mm256_add_epi32(sum_lo[t], scaled_lo);
            }
          }
        }
        for (int t = 0; t < M; ++t) {
          __m256 dot = _mm256_cvtepi32_ps(sum_hi[t]);
          if constexpr (Parts == 2) dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lo[t]), lo_weight, dot);
          total[t][eight] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(a.step[t * groups + g])), total[t][eight]);
        }
      }
    }
    const __m256 s0 = _mm256_loadu_ps(scales + b * kRows), s1 = _mm256_loadu_ps(scales + b * kRows + 8);
    alignas(32) float rows[kRows];
    for (int t = 0; t < M; ++t) {
      _mm256_store_ps(rows, _mm256_mul_ps(total[t][0], s0));
      _mm256_store_ps(rows + 8, _mm256_mul_ps(total[t][1], s1));
      store_rows(out + t * n + b * kRows, rows);
    }
  }
}
#endif

// The int8 op's three layouts (per row: `pack_int8`; 6-bit: `pack_int6`; grouped: `pack_int8_grouped`): bytes of
// a row block, and its loops
enum class Int8Layout { kPerRow, kSix, kGrouped };

template <Int8Layout L>
constexpr int64_t int8_block_bytes(int64_t k) {
  return L == Int8Layout::kSix ? k / kInt6SuperInputs * kInt6BlockBytes
                               : k / kGroup * int8_group_bytes<L == Int8Layout::kGrouped>();
}

template <int Parts, Int8Layout L, typename T>
void int8_product(const at::Tensor& x, const uint8_t* w, const float* scales, at::Tensor& out, bool portable) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), num_blocks = n / kRows;
  const SplitTokens a = split_activations(x.data_ptr<T>(), m, k, Parts == 2, /*part_sums=*/true);
  T* o = out.data_ptr<T>();
  constexpr bool six = L == Int8Layout::kSix, grouped = L == Int8Layout::kGrouped;
  const auto rows_portable = six ? int6_rows_portable<T> : int8_rows_portable<grouped, T>;
  if (portable) return rows_portable(w, a, scales, o, m, k, n, 0, num_blocks);
  for_token_passes(num_blocks, m, int8_block_bytes<L>(k), [&](int64_t t0, int64_t mt, int64_t begin, int64_t end,
                                                              [[maybe_unused]] WeightStream stream) {
#if LLMSERVE_GEMV_AVX512
    with_token_count<kMaxTokens>(mt, [&](auto tokens) {
      constexpr int M = decltype(tokens)::value;
      const auto rows = six ? int6_rows_avx512<M, Parts, T> : int8_rows_avx512<M, Parts, grouped, T>;
      rows(w, a.from(t0, k), scales, o + t0 * n, k, n, begin, end, stream);
    });
#elif LLMSERVE_GEMV_AVX2
    with_token_count<kMaxTokens>(mt, [&](auto tokens) {
      constexpr int M = decltype(tokens)::value;
      const auto rows = six ? int6_rows_avx2<M, Parts, T> : int8_rows_avx2<M, Parts, grouped, T>;
      rows(w, a.from(t0, k), scales, o + t0 * n, k, n, begin, end, stream);
    });
#else
    rows_portable(w, a.from(t0, k), scales, o + t0 * n, mt, k, n, begin, end);
#endif
  });
}

template <Int8Layout L>
void int8_dispatch(const at::Tensor& x, const uint8_t* w, const float* s, at::Tensor& out, int64_t activation_parts,
                   bool portable) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (activation_parts == 2) {
    bf16 ? int8_product<2, L, at::BFloat16>(x, w, s, out, portable) : int8_product<2, L, float>(x, w, s, out, portable);
  } else {
    bf16 ? int8_product<1, L, at::BFloat16>(x, w, s, out, portable) : int8_product<1, L, float>(x, w, s, out, portable);
  }
}

void int8_gemv_into(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                    int64_t activation_parts, at::Tensor& out, bool portable) {
  check_activations(x_in, "int8_gemv");
  TORCH_CHECK(activation_parts == 1 || activation_parts == 2, "int8_gemv: activation_parts must be 1 or 2");
  check_output(x_in, out, "int8_gemv");
  const int64_t n = out.size(1);
  const at::Tensor x = x_in.contiguous();
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kGroup == 0 && n % kRows == 0, "int8_gemv: in_features must be a multiple of 32 and "
              "out_features of 16");
  // the layout is the one whose size the packed weight has (6.625 bits a weight, 8 or 8.5)
  const bool six = k % kInt6SuperInputs == 0 &&
                   packed.numel() == n / kRows * int8_block_bytes<Int8Layout::kSix>(k);
  const bool grouped = packed.numel() == n / kRows * int8_block_bytes<Int8Layout::kGrouped>(k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              (six || grouped || packed.numel() == n * k),
              "int8_gemv: packed weight does not match [", n, ", ", k, "]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              "int8_gemv: scales must be [", n, "] float32");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  if (six) {
    int8_dispatch<Int8Layout::kSix>(x, w, s, out, activation_parts, portable);
  } else if (grouped) {
    int8_dispatch<Int8Layout::kGrouped>(x, w, s, out, activation_parts, portable);
  } else {
    int8_dispatch<Int8Layout::kPerRow>(x, w, s, out, activation_parts, portable);
  }
}

at::Tensor int8_gemv_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                          int64_t activation_parts, bool portable) {
  check_activations(x, "int8_gemv");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  int8_gemv_into(x, packed, scales, activation_parts, out, portable);
  return out;
}

// x [tokens, k] times the int8 weight packed by `pack_int8` (kernels/quantized_gemv.py), row scales
// applied: [tokens, n]. `activation_parts`: x split as for int4_gemv (2: ~16 bits; 1: Q8_0).
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                     int64_t activation_parts) {
  return int8_gemv_impl(x, packed, scales, n, activation_parts, false);
}

at::Tensor int8_gemv_portable(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                              int64_t activation_parts) {
  return int8_gemv_impl(x, packed, scales, n, activation_parts, true);
}

// Whether this build has vector loops (AVX-512 with VNNI, or AVX2 with FMA and F16C); the portable ones
// are for tests only.
bool quantized_gemv_vectorized() {
#if LLMSERVE_GEMV_AVX512 || LLMSERVE_GEMV_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

namespace llmserve::gemv {

// The vector products into a caller's output (the decode stack's step buffers, decode_layer.cpp): the ops' own
// checks and loops without the dispatcher's call and an allocation per product
// (docs/performance.md, "The one-call decode step"). out: [tokens, out_features], contiguous, in x's dtype.
void int4_gemv_out(const at::Tensor& x, const at::Tensor& packed, int64_t activation_parts, at::Tensor& out) {
  int4_gemv_into(x, packed, activation_parts, out, false);
}

void int8_gemv_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t activation_parts,
                   at::Tensor& out) {
  int8_gemv_into(x, packed, scales, activation_parts, out, false);
}

}  // namespace llmserve::gemv

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("quantized_gemv_vectorized() -> bool");
  m.def("int4_gemv(Tensor x, Tensor packed, int n, int activation_parts=2) -> Tensor");
  m.def("int4_gemv_portable(Tensor x, Tensor packed, int n, int activation_parts=2) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor packed, Tensor scales, int n, int activation_parts=2) -> Tensor");
  m.def("int8_gemv_portable(Tensor x, Tensor packed, Tensor scales, int n, int activation_parts=2) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CompositeExplicitAutograd, m) {
  m.impl("quantized_gemv_vectorized", &quantized_gemv_vectorized);
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_gemv_portable", &int4_gemv_portable);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int8_gemv_portable", &int8_gemv_portable);
}
