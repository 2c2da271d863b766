// Decode attention over the paged KV cache, for CPU: one query token per sequence.
//
// Why a kernel: the pure-PyTorch path gathers every sequence's K/V blocks into a padded copy, then runs
// two batched matmuls over it, so each KV byte crosses memory three times, and every layer pays ~6 op
// dispatches. At batch 32 the KV read per step is as large as the weights. Here each (sequence, KV head)
// task reads its blocks in place through the block table, once; the G query heads that share the KV head
// are scored together, so GQA costs no extra KV traffic. Blocks shared by a common prompt prefix are read
// by many tasks and stay in cache.
//
// Layout (see layers/attention/__init__.py): cache [num_blocks, num_kv_heads, block_size, head_dim].
// Scores, softmax and the weighted sum of V run in float32 whatever the cache dtype.
//
// Sliding-window attention (Mistral, Gemma 3's local layers): `window` > 0 attends only each context's last
// `window` tokens (attention_common.h, window_start); 0, the default, the whole context.
//
// bf16 caches: vector loops with vdpbf16ps (AVX512-BF16); on CPUs with AMX the scores (K rows as one tile
// per 16 tokens against the G queries) and the weighted sum of V (the probabilities against V rows
// interleaved in pairs, per 32 tokens) run as tile products instead, the same bf16 products with float32
// sums, faster than the vector loops for a large batch whether its KV is in cache or streamed
// (docs/performance.md, "Decode attention").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_common.h"

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LLMSERVE_ATTENTION_AMX 1
bool request_amx_tiles();  // int8_gemm.cpp: the process's AMX permission, asked for once
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using namespace llmserve::attention;

// A model-dtype cache row: its values as they are (factor 1)
template <typename T>
float read_plain_row(const T* row, int64_t head_dim, float* dst) {
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(row[d]);
  return 1.f;
}


#if defined(__AVX512BF16__)
// bf16 caches on CPUs with AVX512-BF16: dot products with vdpbf16ps (32 bf16 pairs per instruction).
// Scores: each token's partial sums stay a 16-lane vector; 16 tokens are then summed lane-wise by a
// transpose-reduce (15 permute-add steps instead of 16 horizontal reductions). Weighted sum of V: two
// tokens' rows are interleaved so one vdpbf16ps applies (p_t, p_t+1) to (v_t[d], v_t+1[d]); the
// probabilities are rounded to bf16 for it, as a bf16 matmul would.
constexpr int kMaxGroup = 8;   // query heads per KV head
constexpr int kMaxChunks = 4;  // head_dim / 32

bool bf16_fast_path_fits(int64_t group, int64_t head_dim) {
  return group >= 1 && group <= kMaxGroup && head_dim % 32 == 0 && head_dim / 32 >= 1 &&
         head_dim / 32 <= kMaxChunks;
}

#if LLMSERVE_ATTENTION_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tile 0: the chunk's scores [16 tokens][G] (float32); 1: K rows [16 tokens][32 dims] (bf16, one row of the
// cache per token); 2: the query pairs [16 dim pairs][G][2] of one 32-dim part (bf16)
template <int G>
const TileConfig& amx_score_config() {
  static const TileConfig config = [] {
    TileConfig t;
    t.rows[0] = 16, t.colsb[0] = 4 * G;
    t.rows[1] = 16, t.colsb[1] = 64;
    t.rows[2] = 16, t.colsb[2] = 4 * G;
    return t;
  }();
  return config;
}

// The weighted sum of V on AMX (head_dim <= 64): tiles 0..2C-1: the sums [G][16 dims] (float32) of each
// 16-dim slice; 6: probabilities [G][32 tokens] (bf16); 7: V of 32 tokens as pairs [16][16 dims][2] (bf16).
template <int G, int C>
const TileConfig& amx_value_config() {
  static const TileConfig config = [] {
    TileConfig t;
    for (int c = 0; c < 2 * C; ++c) t.rows[c] = G, t.colsb[c] = 64;
    t.rows[6] = G, t.colsb[6] = 64;
    t.rows[7] = 16, t.colsb[7] = 64;
    return t;
  }();
  return config;
}

// sums[g][d] += p[g][t0 + t] v_t[d] over 32 tokens: their V rows are interleaved in pairs (the order the
// tile product reads) into `pairs`, one 16-dim slice per tile. Tokens past the context read `zero_row` and
// have probability 0.
template <int G, int C>
inline void accumulate_values_amx(RowWalker<uint16_t>& v_rows, int64_t t0, int64_t ctx, const uint16_t* zero_row,
                                  const uint16_t* probs, int64_t probs_stride, uint16_t (*pairs)[16 * 32],
                                  __m512i interleave_lo, __m512i interleave_hi) {
  for (int p = 0; p < 16; ++p) {
    const int64_t t = t0 + 2 * p;
    const uint16_t* v0 = t < ctx ? v_rows.next() : zero_row;
    const uint16_t* v1 = t + 1 < ctx ? v_rows.next() : zero_row;
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      _mm512_store_si512(pairs[2 * c] + 32 * p, _mm512_permutex2var_epi16(a, interleave_lo, b));
      _mm512_store_si512(pairs[2 * c + 1] + 32 * p, _mm512_permutex2var_epi16(a, interleave_hi, b));
    }
  }
  _tile_loadd(6, probs + t0, 2 * probs_stride);
  _tile_loadd(7, pairs[0], 64);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(7, pairs[1], 64);
  _tile_dpbf16ps(1, 6, 7);
  if constexpr (C > 1) {
    _tile_loadd(7, pairs[2], 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(7, pairs[3], 64);
    _tile_dpbf16ps(3, 6, 7);
  }
}

// scores[g * ctx + t] = scale * q_g . k_t for the n (<= 16) tokens of a chunk whose K rows start at `rows`
// (contiguous, head_dim apart; rows past n are other tokens' or stale, and are computed but not kept).
// The products are float32 sums of bf16 pairs, as vdpbf16ps makes them.
template <int G, int C>
inline void score_chunk_amx(const uint16_t* rows, const uint16_t (*q_pairs)[16 * 2 * G], __m512 vscale,
                            float* scores, int64_t ctx, int64_t n) {
  _tile_zero(0);
  for (int c = 0; c < C; ++c) {  // each 32-dim part of the rows against its query pairs
    _tile_loadd(1, rows + 32 * c, 64 * C);
    _tile_loadd(2, q_pairs[c], 4 * G);
    _tile_dpbf16ps(0, 1, 2);
  }
  alignas(64) float chunk[16 * G];  // [token][query head]
  _tile_stored(0, chunk, 4 * G);
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  const __m512i token = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(G));
  for (int g = 0; g < G; ++g) {
    const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, _mm512_add_epi32(token, _mm512_set1_epi32(g)), chunk, 4);
    _mm512_mask_storeu_ps(scores + g * ctx, mask, _mm512_mul_ps(column, vscale));
  }
}
#endif

// The query heads per KV head (G) and the 32-wide chunks of head_dim (C) are template parameters: every
// loop over them unrolls and the queries, partial sums and accumulators stay in registers (with runtime
// bounds they would live on the stack, and the loop control would take a large share of the kernel's time).
template <int G, int C>
void decode_kernel_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& context_lens, double scale, int64_t window,
                        at::Tensor& out) {
  constexpr int64_t head_dim = 32 * C;
  const int64_t batch = q.size(0), num_heads = q.size(1);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t max_blocks = block_table.size(1);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));
  static const ReduceIndex reduce_index;
  alignas(64) static const uint16_t zero_row[head_dim] = {};  // stands in for the tokens past the end
  static const PairLaneOrder lanes;  // acc lanes -> head_dim order (see the V loop)
  const __m512i perm_a = lanes.a, perm_b = lanes.b;
  const int64_t pairs = batch * num_kv_heads;
  const ContextSplit split = split_contexts(lens, batch, window, block_size);
  const int64_t parts = split.parts;
  // per task and query head: the scores' max, the sum of their exponentials, the unnormalised V sum
  constexpr int64_t stride = head_dim + 2;
  // not zeroed: every task writes its own (and a zeroing here would pass each line written on another core twice)
  std::unique_ptr<float[]> partial(new float[pairs * parts * G * stride]);

#if LLMSERVE_ATTENTION_AMX
  // Scores on AMX where a 16-token chunk never crosses a block (its K rows are one tile; parts start at
  // multiples of 16): 2 tile loads and 2 tile products per chunk, instead of ~230 vector instructions for
  // G = 3 (see score_chunk_amx).
  const bool amx = block_size % 16 == 0 && request_amx_tiles();
#else
  constexpr bool amx = false;
#endif
  // and the weighted sum of V too where head_dim <= 64 (2C sum tiles fit beside the probability and V ones)
  constexpr bool kValueTilesFit = C <= 2;
  const bool amx_values = amx && kValueTilesFit;
#if LLMSERVE_ATTENTION_AMX
  alignas(64) int16_t lo_order[32], hi_order[32];  // interleave two tokens' rows: (a0, b0, a1, b1, ...)
  for (int i = 0; i < 32; ++i) lo_order[i] = i / 2 + (i % 2) * 32, hi_order[i] = 16 + i / 2 + (i % 2) * 32;
  const __m512i interleave_lo = _mm512_load_si512(lo_order), interleave_hi = _mm512_load_si512(hi_order);
#endif
  run_tasks(pairs * parts, [&](auto next_task) {
    std::vector<float> scores;
    std::vector<uint16_t> probs;  // bf16, [G][tokens rounded up to even, or to 32 for the tiles]
#if LLMSERVE_ATTENTION_AMX
    alignas(64) uint16_t q_pairs[C][16 * 2 * G];  // the B tiles: [dim pair][query head][2]
    alignas(64) uint16_t v_pairs[2 * C][16 * 32];
#endif
    for (int64_t task; (task = next_task()) >= 0;) {
      const PartTask part(task, split, num_kv_heads, lens);
      const int64_t b = part.b, h = part.h, first = part.first, ctx = part.ctx;
      const int64_t ctx2 = amx_values ? (ctx + 31) & ~int64_t(31) : (ctx + 1) & ~int64_t(1);
      float* result = partial.get() + task * G * stride;
      if (ctx == 0) {  // a short context's later parts
        PartTask::empty(result, G, stride);
        continue;
      }
      const int32_t* blocks = table + b * max_blocks;
      RowWalker<uint16_t> k_rows(k_ptr, blocks, h, num_kv_heads, block_size, head_dim, first, first + ctx);
      RowWalker<uint16_t> v_rows(v_ptr, blocks, h, num_kv_heads, block_size, head_dim, first, first + ctx);
      scores.resize(G * ctx);
#if LLMSERVE_ATTENTION_AMX
      if (amx) {
        _tile_loadconfig(&amx_score_config<G>());
        const uint16_t* q_rows = q_ptr + (b * num_heads + h * G) * head_dim;
        for (int c = 0; c < C; ++c)
          for (int p = 0; p < 16; ++p)
            for (int g = 0; g < G; ++g)
              for (int j = 0; j < 2; ++j) q_pairs[c][(p * G + g) * 2 + j] = q_rows[g * head_dim + c * 32 + 2 * p + j];
        for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
          const int64_t n = std::min<int64_t>(16, ctx - t0);
          const uint16_t* rows = k_rows.next();  // the chunk's first row; the others follow it in its block
          for (int64_t t = 1; t < n; ++t) k_rows.next();
          score_chunk_amx<G, C>(rows, q_pairs, vscale, scores.data() + t0, ctx, n);
        }
      } else
#endif
      {  // the vector loops
        __m512bh qv[G][C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c)
            qv[g][c] = (__m512bh)_mm512_loadu_si512(q_ptr + (b * num_heads + h * G + g) * head_dim + c * 32);
        for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
          const int64_t n = std::min<int64_t>(16, ctx - t0);
          const uint16_t* krow[16];
          if (const uint16_t* first_row = n == 16 ? k_rows.run(16) : nullptr) {  // a whole chunk in one block
            for (int t = 0; t < 16; ++t) krow[t] = first_row + t * head_dim;
          } else {
            for (int t = 0; t < 16; ++t) krow[t] = t < n ? k_rows.next() : zero_row;
          }
          const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
          for (int g = 0; g < G; ++g) {  // one head at a time: 16 partial sums fit in registers
            __m512 part[16];
            for (int t = 0; t < 16; ++t) {
              __m512 acc = _mm512_setzero_ps();
              for (int c = 0; c < C; ++c)
                acc = _mm512_dpbf16_ps(acc, qv[g][c], (__m512bh)_mm512_loadu_si512(krow[t] + c * 32));
              part[t] = acc;
            }
            _mm512_mask_storeu_ps(scores.data() + g * ctx + t0, mask,
                                  _mm512_mul_ps(transpose_reduce16(part, reduce_index), vscale));
          }
        }
      }
      probs.assign(G * ctx2, 0);
      for (int g = 0; g < G; ++g) {
        float* s = scores.data() + g * ctx;
        const ExpSum stats = exp_shifted16(s + part.skip, ctx - part.skip);
        std::fill_n(s, part.skip, 0.f);  // before the window
        result[g * stride] = stats.max;
        result[g * stride + 1] = stats.sum;
        uint16_t* p = probs.data() + g * ctx2;
        for (int64_t t = 0; t < ctx; t += 16) {
          const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, ctx - t)) - 1);
          _mm256_mask_storeu_epi16(p + t, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, s + t)));
        }
      }
#if LLMSERVE_ATTENTION_AMX
      if constexpr (kValueTilesFit) {
        if (amx_values) {
          _tile_loadconfig(&amx_value_config<G, C>());
          _tile_zero(0);
          _tile_zero(1);
          if constexpr (C > 1) {
            _tile_zero(2);
            _tile_zero(3);
          }
          for (int64_t t0 = 0; t0 < ctx; t0 += 32)
            accumulate_values_amx<G, C>(v_rows, t0, ctx, zero_row, probs.data(), ctx2, v_pairs, interleave_lo,
                                        interleave_hi);
          _tile_stored(0, result + 2, 4 * stride);
          _tile_stored(1, result + 2 + 16, 4 * stride);
          if constexpr (C > 1) {
            _tile_stored(2, result + 2 + 32, 4 * stride);
            _tile_stored(3, result + 2 + 48, 4 * stride);
          }
          continue;
        }
      }
#endif
      __m512 acc[G][2 * C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_setzero_ps();
      const uint16_t* chunk = nullptr;  // the current 16 tokens' rows where they lie in one block
      for (int64_t t = 0; t < ctx; t += 2) {
        if (t % 16 == 0) chunk = ctx - t >= 16 ? v_rows.run(16) : nullptr;
        const uint16_t* v0 = chunk ? chunk + (t % 16) * head_dim : v_rows.next();
        const uint16_t* v1 = chunk ? v0 + head_dim : t + 1 < ctx ? v_rows.next() : zero_row;
        __m512bh pp[G];
        for (int g = 0; g < G; ++g) {
          uint32_t pair;
          std::memcpy(&pair, probs.data() + g * ctx2 + t, sizeof(pair));
          pp[g] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
        }
        for (int c = 0; c < C; ++c) {
          const __m512i a = _mm512_loadu_si512(v0 + c * 32), b2 = _mm512_loadu_si512(v1 + c * 32);
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b2), hi = (__m512bh)_mm512_unpackhi_epi16(a, b2);
          for (int g = 0; g < G; ++g) {
            acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, pp[g]);
            acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, pp[g]);
          }
        }
      }
      for (int g = 0; g < G; ++g) {  // back to head_dim order
        float* dst = result + g * stride + 2;
        for (int c = 0; c < C; ++c) {
          _mm512_storeu_ps(dst + c * 32, _mm512_permutex2var_ps(acc[g][2 * c], perm_a, acc[g][2 * c + 1]));
          _mm512_storeu_ps(dst + c * 32 + 16, _mm512_permutex2var_ps(acc[g][2 * c], perm_b, acc[g][2 * c + 1]));
        }
      }
    }
#if LLMSERVE_ATTENTION_AMX
    if (amx) _tile_release();
#endif
  }, split.interleaved);

  // merge each query head's parts: weights exp(max_p - max) on their sums and V sums
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
    for (int g = 0; g < G; ++g) {
      const float* first = partial.get() + (pair * parts * G + g) * stride;
      float mx = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, first[p * G * stride]);
      __m512 sum[2 * C];
      for (int c = 0; c < 2 * C; ++c) sum[c] = _mm512_setzero_ps();
      float total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float* r = first + p * G * stride;
        if (r[1] == 0.f) continue;
        const float w = std::exp(r[0] - mx);
        total += w * r[1];
        for (int c = 0; c < 2 * C; ++c) sum[c] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(r + 2 + 16 * c), sum[c]);
      }
      const __m512 inv = _mm512_set1_ps(1.f / total);
      uint16_t* dst = out_ptr + (b * num_heads + h * G + g) * head_dim;
      for (int c = 0; c < 2 * C; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sum[c], inv)));
    }
  }
}

template <int G, int... Cs>
constexpr std::array<DecodeKernel, sizeof...(Cs)> kernels_for_group(std::integer_sequence<int, Cs...>) {
  return {&decode_kernel_bf16<G, Cs + 1>...};
}

template <int... Gs>
constexpr auto bf16_kernel_table(std::integer_sequence<int, Gs...>) {
  return std::array<std::array<DecodeKernel, kMaxChunks>, sizeof...(Gs)>{
      kernels_for_group<Gs + 1>(std::make_integer_sequence<int, kMaxChunks>{})...};
}

// [group - 1][head_dim / 32 - 1]
constexpr auto kBf16Kernels = bf16_kernel_table(std::make_integer_sequence<int, kMaxGroup>{});
#endif  // __AVX512BF16__

#if defined(__AVX2__) && defined(__FMA__)
// float32 caches (hosts without native bfloat16 run float32: AVX2-only ones) and bf16 caches on CPUs without
// AVX512-BF16: 8 float32 lanes of each row at a time (a bf16 row widened in registers, a shift of each 16-bit
// value), float32 products and sums, the contexts split into parts as the AVX512-BF16 kernel's. The portable loop
// (decode_portable) reads each row through a buffer, keeps its sums in memory and never splits a context, which
// makes it far slower for either dtype (docs/performance.md, "Decode attention"). The scores of eight tokens are
// reduced together (`sum8x8`), not one horizontal sum per token and query head: it matters most with K/V in
// cache; from memory, where the step's K/V come from, the stream bounds it.
constexpr int kMaxGroupAvx2 = 8;  // query heads per KV head

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {  // 8 bf16 values as float32
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float sum8(__m256 v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

// the 8 lane sums of d[0..8), in order: three rounds of pairwise adds (hadd), then the two halves' sums
inline __m256 sum8x8(const __m256* d) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Row: the cache's element as stored (float, or uint16_t for bf16); T: q's and out's dtype
template <typename T, typename Row, int G>
void decode_kernel_avx2(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& context_lens, double scale, int64_t window,
                        at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2), c8 = head_dim / 8;
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2), max_blocks = block_table.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const auto* k_ptr = static_cast<const Row*>(k_cache.data_ptr());
  const auto* v_ptr = static_cast<const Row*>(v_cache.data_ptr());
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t pairs = batch * num_kv_heads;
  const ContextSplit split = split_contexts(lens, batch, window, block_size);
  const int64_t parts = split.parts;
  // per task and query head: the scores' max, the sum of their exponentials, the unnormalised V sum
  const int64_t stride = head_dim + 2;
  std::unique_ptr<float[]> partial(new float[pairs * parts * G * stride]);
  run_tasks(pairs * parts, [&](auto next_task) {
    std::vector<float> qf(G * head_dim), acc(G * head_dim), scores;
    for (int64_t task; (task = next_task()) >= 0;) {
      const PartTask part(task, split, num_kv_heads, lens);
      const int64_t b = part.b, h = part.h, first = part.first, ctx = part.ctx;
      float* result = partial.get() + task * G * stride;
      if (ctx == 0) {  // a short context's later parts
        PartTask::empty(result, G, stride);
        continue;
      }
      const int32_t* blocks = table + b * max_blocks;
      const T* q_rows = q_ptr + (b * num_heads + h * G) * head_dim;
      for (int64_t i = 0; i < G * head_dim; ++i) qf[i] = to_float(q_rows[i]) * fscale;
      RowWalker<Row> k_rows(k_ptr, blocks, h, num_kv_heads, block_size, head_dim, first, first + ctx);
      RowWalker<Row> v_rows(v_ptr, blocks, h, num_kv_heads, block_size, head_dim, first, first + ctx);
      scores.resize(G * ctx);
      int64_t t = 0;
      for (; t + 8 <= ctx; t += 8) {  // scores[g, t..t+8) = q_g . k_t, eight tokens' sums reduced together
        const Row* rows[8];
        for (int j = 0; j < 8; ++j) rows[j] = k_rows.next();
        for (int g = 0; g < G; ++g) {
          __m256 dot[8];
          for (int j = 0; j < 8; ++j) dot[j] = _mm256_setzero_ps();
          for (int64_t c = 0; c < c8; ++c) {
            const __m256 qv = _mm256_loadu_ps(&qf[g * head_dim + 8 * c]);
            for (int j = 0; j < 8; ++j) dot[j] = _mm256_fmadd_ps(qv, load8(rows[j] + 8 * c), dot[j]);
          }
          _mm256_storeu_ps(&scores[g * ctx + t], sum8x8(dot));
        }
      }
      for (; t < ctx; ++t) {  // the last ctx % 8 tokens one at a time
        const Row* row = k_rows.next();
        __m256 dot[G];
        for (int g = 0; g < G; ++g) dot[g] = _mm256_setzero_ps();
        for (int64_t c = 0; c < c8; ++c) {
          const __m256 k = load8(row + 8 * c);
          for (int g = 0; g < G; ++g) dot[g] = _mm256_fmadd_ps(_mm256_loadu_ps(&qf[g * head_dim + 8 * c]), k, dot[g]);
        }
        for (int g = 0; g < G; ++g) scores[g * ctx + t] = sum8(dot[g]);
      }
      for (int g = 0; g < G; ++g) {
        float* s = scores.data() + g * ctx;
        const ExpSum stats = exp_shifted8(s + part.skip, ctx - part.skip);
        std::fill_n(s, part.skip, 0.f);  // before the window
        result[g * stride] = stats.max;
        result[g * stride + 1] = stats.sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; t += 4) {  // acc[g] += e[g, t] v_t, four tokens a pass over acc
        const Row* rows[4];
        __m256 p[4][G];
        for (int j = 0; j < 4; ++j) {
          const bool real = t + j < ctx;
          rows[j] = real ? v_rows.next() : nullptr;
          for (int g = 0; g < G; ++g) p[j][g] = _mm256_set1_ps(real ? scores[g * ctx + t + j] : 0.f);
        }
        for (int j = 1; j < 4; ++j) rows[j] = rows[j] ? rows[j] : rows[0];  // past the end: weight 0
        for (int64_t c = 0; c < c8; ++c) {
          const __m256 v0 = load8(rows[0] + 8 * c), v1 = load8(rows[1] + 8 * c);
          const __m256 v2 = load8(rows[2] + 8 * c), v3 = load8(rows[3] + 8 * c);
          for (int g = 0; g < G; ++g) {
            float* a = &acc[g * head_dim + 8 * c];
            __m256 sum = _mm256_fmadd_ps(p[0][g], v0, _mm256_loadu_ps(a));
            sum = _mm256_fmadd_ps(p[1][g], v1, sum);
            sum = _mm256_fmadd_ps(p[2][g], v2, sum);
            _mm256_storeu_ps(a, _mm256_fmadd_ps(p[3][g], v3, sum));
          }
        }
      }
      for (int g = 0; g < G; ++g) std::copy_n(&acc[g * head_dim], head_dim, result + g * stride + 2);
    }
  }, split.interleaved);

  merge_parts(partial.get(), pairs, parts, G, head_dim, num_kv_heads, out_ptr);
}

template <typename T, typename Row, int... Gs>
constexpr std::array<DecodeKernel, sizeof...(Gs)> avx2_kernels(std::integer_sequence<int, Gs...>) {
  return {&decode_kernel_avx2<T, Row, Gs + 1>...};
}

constexpr auto kFloatAvx2Kernels = avx2_kernels<float, float>(std::make_integer_sequence<int, kMaxGroupAvx2>{});
#if !defined(__AVX512BF16__)
constexpr auto kBf16Avx2Kernels =
    avx2_kernels<at::BFloat16, uint16_t>(std::make_integer_sequence<int, kMaxGroupAvx2>{});
#endif
#endif  // AVX2 and FMA

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& context_lens, double scale,
                                  int64_t window) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  llmserve::attention::decode_attention_out(q, k_cache, v_cache, block_table, context_lens, scale, out, window);
  return out;
}

// k, v [T, kv_heads, head_dim] -> the caches seen as [slots, head_dim], one slot per (token, kv head).
// An op of its own (not index_copy_ in Python) so a compiled model sees the cache write as one in-place op.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected k, v [T, kv_heads, head_dim] and caches [blocks, kv_heads, block_size, head_dim]");
  const bool quantized = is_quantized_cache(k_cache);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  (quantized || k.scalar_type() == k_cache.scalar_type()),
              "k, v and the caches must share a dtype (the caches may be quantized: int8, float8_e4m3fn)");
  TORCH_CHECK(k.size(2) == cache_head_dim(k_cache) && k.size(1) == k_cache.size(1), "k/v heads must match the cache");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0) * k.size(1),
              "slots: one int64 per (token, kv head)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), sl = slots.contiguous();
  const int64_t rows = sl.numel(), head_dim = k.size(2), num_slots = k_cache.numel() / k_cache.size(3);
  const int64_t bytes = head_dim * k.element_size();
  const int64_t* slot = sl.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slot[r] >= 0 && slot[r] < num_slots, "KV slot out of range");
  if (quantized) return write_quantized(kc, vc, k_cache, v_cache, slot, rows);
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(kd + slot[r] * bytes, ks + r * bytes, bytes);
    std::memcpy(vd + slot[r] * bytes, vs + r * bytes, bytes);
  }
}

}  // namespace

namespace llmserve::attention {

void decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const at::Tensor& context_lens, double scale,
                          at::Tensor& out, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [B, heads, head_dim] and caches [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "paged_decode_attention: out must be contiguous, q's shape and dtype");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_attention is a CPU kernel");
  const bool quantized = is_quantized_cache(k_cache);
  TORCH_CHECK((quantized || q.scalar_type() == k_cache.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must share a dtype, q's unless they are quantized (int8, float8_e4m3fn)");
  TORCH_CHECK(q.size(2) == cache_head_dim(k_cache) && q.size(1) % k_cache.size(1) == 0,
              "head_dim must match and heads must be a multiple of kv_heads");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_table and context_lens must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "one block-table row and one context length per query");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: the whole context)");
  const at::Tensor qc = q.contiguous(), table = block_table.contiguous(), lens = context_lens.contiguous();
  // a bad index would read outside the cache: check them all (a few hundred ints) before any work; a window's
  // kernels read no block before the one holding its first token, so the table's earlier ids go unchecked
  const int64_t width = table.size(1), block_size = k_cache.size(2), num_blocks = k_cache.size(0);
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < qc.size(0); ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * block_size, "context length out of range for the block table");
    for (int64_t i = read_start(lp[b], window, block_size) / block_size; i < (lp[b] + block_size - 1) / block_size;
         ++i)
      TORCH_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < num_blocks, "block id out of range");
  }
  if (quantized) {
    out.copy_(decode_quantized(qc, k_cache, v_cache, table, lens, scale, window));
    return;
  }
#if defined(__AVX512BF16__)
  if (qc.scalar_type() == at::kBFloat16 && bf16_fast_path_fits(qc.size(1) / k_cache.size(1), qc.size(2))) {
    kBf16Kernels[qc.size(1) / k_cache.size(1) - 1][qc.size(2) / 32 - 1](qc, k_cache, v_cache, table, lens, scale,
                                                                        window, out);
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t group = qc.size(1) / k_cache.size(1);
  if (group <= kMaxGroupAvx2 && qc.size(2) % 8 == 0) {
    if (qc.scalar_type() == at::kFloat) {
      kFloatAvx2Kernels[group - 1](qc, k_cache, v_cache, table, lens, scale, window, out);
      return;
    }
#if !defined(__AVX512BF16__)
    if (qc.scalar_type() == at::kBFloat16) {
      kBf16Avx2Kernels[group - 1](qc, k_cache, v_cache, table, lens, scale, window, out);
      return;
    }
#endif
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_portable<scalar_t, scalar_t>(qc, k_cache, v_cache, table, lens, scale, window, out,
                                        read_plain_row<scalar_t>);
  });
}

}  // namespace llmserve::attention

TORCH_LIBRARY(llmserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor context_lens, float scale, int window=0) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
