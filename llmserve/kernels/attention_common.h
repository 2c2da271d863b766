// Pieces the paged-attention kernels share (paged_attention.cpp: model-dtype caches;
// paged_attention_quantized.cpp: 1-byte caches): walking a context's rows through its block table,
// running (sequence, KV head) tasks on torch's threads, and the softmax's vector helpers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd_exp.h"
#include "team.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace llmserve {
namespace attention {

// 1-byte caches (int8, fp8 e4m3; paged_attention_quantized.cpp): rows of head_dim values and a float32 scale
bool is_quantized_cache(const at::Tensor& cache);
int64_t cache_head_dim(const at::Tensor& cache);
at::Tensor decode_quantized(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& context_lens, double scale,
                            int64_t window);
// `paged_decode_attention` into a caller's output (contiguous, q's shape and dtype): the op's checks and kernels
// without the dispatcher's call and the output's allocation (the decode stack's step buffer, decode_layer.cpp).
// `window`: as the op's (0: the whole context).
void decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const at::Tensor& context_lens, double scale, at::Tensor& out,
                          int64_t window = 0);
// k, v [rows, head_dim] (contiguous) quantized into the caches' rows `slots` (checked by the caller)
void write_quantized(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     const int64_t* slots, int64_t rows);

// Sliding-window attention (`window` > 0, transformers' semantics): the query at position len - 1 attends the
// keys at positions p with len - 1 - window < p <= len - 1, the context's last `window` tokens; 0: all of them.
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

// Where the split kernels start reading a windowed context: the window's start rounded down to a multiple of 16 (their
// parts and 16-token runs start at one: the AMX score tiles need it), but never into an earlier block (blocks that
// left the window need not be valid). The tokens read before the window get probability 0 (`PartTask::skip`).
inline int64_t read_start(int64_t len, int64_t window, int64_t block_size) {
  const int64_t start = window_start(len, window);
  return start ? std::max(start & ~int64_t{15}, start - start % block_size) : 0;
}

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

struct ExpSum {
  float max;  // of the scores
  float sum;  // of their exponentials, shifted by max
};

// s[t] = exp(s[t] - max(s)) in place; the softmax's normaliser is 1 / sum
inline ExpSum exp_shifted(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return {mx, sum};
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_shifted, 8 scores at a time (the AVX2 kernels; exp8 in simd_exp.h)
inline ExpSum exp_shifted8(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  const __m256 shift = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = llmserve::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float tail[8] = {};  // the last n % 8 scores (the lanes past them are not summed)
  std::copy(s + t, s + n, tail);
  _mm256_store_ps(tail, llmserve::exp8(_mm256_sub_ps(_mm256_load_ps(tail), shift)));
  std::copy(tail, tail + (n - t), s + t);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  for (int64_t i = 0; i < n - t; ++i) total += tail[i];
  return {mx, total};
}
#endif

// One (sequence, KV head)'s context rows [first_token, end_token), token by token through its block table (no
// division per token), or a run of tokens at once where they lie in one block. Cache layout [num_blocks,
// num_kv_heads, block_size, head_dim]. Each block holds a (block, head)'s rows contiguously (2 KiB for SmolLM2),
// but consecutive blocks lie anywhere in the cache, so the hardware prefetcher stops at every block edge: the walker
// prefetches the blocks ahead itself, which matters most for a long context that has left the cache
// (docs/performance.md, "Decode attention").
template <typename T>
class RowWalker {
 public:
  static constexpr int64_t kBlocksAhead = 4;

  RowWalker(const T* cache, const int32_t* blocks, int64_t kv_head, int64_t num_kv_heads, int64_t block_size,
            int64_t head_dim, int64_t first_token, int64_t end_token)
      : cache_(cache), block_(blocks + first_token / block_size),
        end_(blocks + (end_token + block_size - 1) / block_size), head_(kv_head), num_kv_heads_(num_kv_heads),
        block_size_(block_size), head_dim_(head_dim), offset_(first_token % block_size) {
    for (int64_t i = 0; i < kBlocksAhead; ++i) prefetch(block_ + i);
  }

  const T* next() { return take(1); }

  // The first of the next n rows where all n lie in the current block (each row head_dim after the one before), so
  // a loop over them computes no address per row; nullptr, the walk unmoved, where they cross a block's end. The
  // kernels take 16 tokens at a time this way (a part starts at a multiple of 16;
  // docs/performance.md, "Decode attention").
  const T* run(int64_t n) { return offset_ + n <= block_size_ ? take(n) : nullptr; }

 private:
  const T* take(int64_t n) {
    const T* row = cache_ + ((static_cast<int64_t>(*block_) * num_kv_heads_ + head_) * block_size_ + offset_) * head_dim_;
    if ((offset_ += n) == block_size_) {
      offset_ = 0;
      ++block_;
      prefetch(block_ + kBlocksAhead - 1);
    }
    return row;
  }

  // always inlined: as a function of its own, its body only prefetches, so GCC's pure-const analysis finds it
  // free of effects and deletes every call (GCC 12, -O1 and up: no prefetch would be emitted at all).
  // Into L2 (prefetcht1), not L1: chosen by measurement, not derived (prefetcht0 did no better than no prefetch);
  // likely a prefetch into L1 waits for one of the core's few L1 miss buffers, so 32 of them a block stall the loads
  // they run ahead of, where L2 tracks many more misses and a row's load from L2 costs little beside the arithmetic
  // on it (docs/performance.md, "Decode attention").
  __attribute__((always_inline)) void prefetch(const int32_t* block) const {
    if (block >= end_) return;
    const char* rows = reinterpret_cast<const char*>(
        cache_ + (static_cast<int64_t>(*block) * num_kv_heads_ + head_) * block_size_ * head_dim_);
    for (int64_t line = 0; line < block_size_ * head_dim_ * static_cast<int64_t>(sizeof(T)); line += 64)
      __builtin_prefetch(rows + line, 0, 2);
  }

  const T* cache_;
  const int32_t* block_;
  const int32_t* end_;
  int64_t head_, num_kv_heads_, block_size_, head_dim_, offset_;
};

// Runs the tasks on torch's threads. Dynamic (`interleaved` false): each thread takes the next task from a shared
// counter: contexts differ in length, and a static split leaves one thread waiting for the other. Interleaved:
// thread t runs tasks t, t + threads, ... with no shared counter: where every context is split into a multiple of
// the threads' count of parts (`split_contexts`), each thread gets its share of every context, balanced as it is,
// and a claim is no longer a cache line passed between cores, which costs most where they share no L3
// (docs/performance.md, "Decode attention").
// `worker(next_task)` runs once per thread (so it can keep scratch buffers); next_task() returns -1 when
// none is left.
template <typename Worker>
void run_tasks(int64_t num_tasks, const Worker& worker, bool interleaved = false) {
  const int64_t threads = at::get_num_threads();
  if (interleaved) {
    team::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {  // one index a thread, or more if fewer ran
      int64_t lane = begin, task = begin;
      worker([&] {
        if (task >= num_tasks && ++lane < end) task = lane;
        if (task >= num_tasks) return int64_t{-1};
        const int64_t claimed = task;
        task += threads;
        return claimed;
      });
    });
    return;
  }
  std::atomic<int64_t> next{0};
  team::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    worker([&] {
      const int64_t task = next++;
      return task < num_tasks ? task : int64_t{-1};
    });
  });
}

// The portable decode attention, float32 throughout, one task per (sequence, KV head): what runs where no
// vector kernel fits the cache, the dtype or the CPU. `Row` is the cache's element as stored (its rows are
// k_cache.size(3) wide); `read_row(row, head_dim, dst)` writes a row's values as float32 and returns the
// factor that multiplies them (1 for a model-dtype cache, the row's scale for a 1-byte one): it multiplies a
// token's score (K) and its probability (V).
template <typename T, typename Row, typename ReadRow>
void decode_portable(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& context_lens, double scale, int64_t window,
                     at::Tensor& out, const ReadRow& read_row) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2), width = k_cache.size(3);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_table.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const auto* k_ptr = static_cast<const Row*>(k_cache.data_ptr());
  const auto* v_ptr = static_cast<const Row*>(v_cache.data_ptr());
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  run_tasks(batch * num_kv_heads, [&](auto next_task) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t task; (task = next_task()) >= 0;) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first = window_start(lens[b], window), ctx = lens[b] - first;  // the tokens attended
      const int32_t* blocks = table + b * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = to_float(q_ptr[(b * num_heads + h * group + g) * head_dim + d]) * fscale;
      scores.resize(group * ctx);
      // scores[g, t] = q_g . k_t
      RowWalker<Row> k_rows(k_ptr, blocks, h, num_kv_heads, block_size, width, first, first + ctx);
      for (int64_t t = 0; t < ctx; ++t) {
        const float factor = read_row(k_rows.next(), head_dim, row.data());
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) s += qf[g * head_dim + d] * row[d];
          scores[g * ctx + t] = s * factor;
        }
      }
      // softmax per query head
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * ctx;
        const float inv = 1.f / exp_shifted(s, ctx).sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      // acc[g] = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      RowWalker<Row> v_rows(v_ptr, blocks, h, num_kv_heads, block_size, width, first, first + ctx);
      for (int64_t t = 0; t < ctx; ++t) {
        const float factor = read_row(v_rows.next(), head_dim, row.data());
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t] * factor;
          for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out_ptr[(b * num_heads + h * group + g) * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
    }
  });
}

// Each context is split into `parts` of `part_len` tokens (kPartTokens, whatever the batch) whose softmax statistics
// are merged at the end (flash-decoding): the split keeps every thread busy in a step of one or two requests, and
// since where a part starts depends on a row's own context only, a query's result has the same bits whatever else
// its step holds (batch-invariant: alone or beside others, a prompt token or a decode). Parts come in a multiple
// of the threads' count where contexts are long enough, and then the tasks run interleaved (`run_tasks`). A windowed
// context (`window` > 0) is split from its `read_start` on.
// A part's tokens: a multiple of 16 (the AMX score tiles' chunk); 128 keeps two threads busy on one request's
// context of a few hundred tokens, at a merge of 66 floats a query head per part.
constexpr int64_t kPartTokens = 128;

struct ContextSplit {
  int64_t parts, part_len;
  bool interleaved;
  int64_t window, block_size;
};

// A decode kernel's entry (q, k_cache, v_cache, block_table, context_lens, scale, window, out): each vector kernel's
// compile-time variants (query heads per KV head, head_dim chunks) sit in a table of these, picked at run time.
using DecodeKernel = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, double, int64_t, at::Tensor&);

// One task of a split: sequence b's KV head h over tokens [first, first + ctx). `ctx` is 0 for a short context's
// later parts: such a task writes `empty` statistics, which `merge_parts` skips. Its first `skip` tokens lie before
// the sliding window (read only to keep the part's start aligned): the kernel gives them probability 0.
struct PartTask {
  int64_t b, h, first, ctx, skip;

  PartTask(int64_t task, const ContextSplit& split, int64_t num_kv_heads, const int32_t* lens)
      : b(task / (num_kv_heads * split.parts)),
        h(task / split.parts % num_kv_heads),
        first(read_start(lens[b], split.window, split.block_size) + task % split.parts * split.part_len),
        ctx(std::max<int64_t>(0, std::min<int64_t>(lens[b] - first, split.part_len))),
        skip(std::clamp<int64_t>(window_start(lens[b], split.window) - first, 0, ctx)) {}

  // the part's per-query-head statistics (max, sum; rows of `stride` floats) when it has no token
  static void empty(float* result, int64_t group, int64_t stride) {
    for (int64_t g = 0; g < group; ++g) result[g * stride] = -INFINITY, result[g * stride + 1] = 0.f;
  }
};

inline ContextSplit split_contexts(const int32_t* lens, int64_t batch, int64_t window, int64_t block_size) {
  int64_t max_ctx = 0;  // the most tokens a context reads
  for (int64_t b = 0; b < batch; ++b)
    max_ctx = std::max<int64_t>(max_ctx, lens[b] - read_start(lens[b], window, block_size));
  const int64_t parts = std::max<int64_t>(1, (max_ctx + kPartTokens - 1) / kPartTokens);
  return {parts, kPartTokens, parts > 1 && parts % at::get_num_threads() == 0, window, block_size};
}

// Merges each query head's parts (flash-decoding): `partial` holds, per (sequence, KV head) pair, part and query
// head, the part's score max, the sum of its exponentials and its unnormalised V sum ([2 + head_dim] floats); the
// parts are weighted by exp(max_p - max) and out (q's layout) gets sum / total, in float32, rounded once.
template <typename T>
void merge_parts(const float* partial, int64_t pairs, int64_t parts, int64_t group, int64_t head_dim,
                 int64_t num_kv_heads, T* out) {
  const int64_t stride = head_dim + 2, num_heads = num_kv_heads * group;
  std::vector<float> sum(head_dim);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / num_kv_heads, h = pair % num_kv_heads;
    for (int64_t g = 0; g < group; ++g) {
      const float* first = partial + (pair * parts * group + g) * stride;
      float mx = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, first[p * group * stride]);
      std::fill(sum.begin(), sum.end(), 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const float* r = first + p * group * stride;
        if (r[1] == 0.f) continue;
        const float w = std::exp(r[0] - mx);
        total += w * r[1];
        for (int64_t d = 0; d < head_dim; ++d) sum[d] += w * r[2 + d];
      }
      T* dst = out + (b * num_heads + h * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(sum[d] / total);
    }
  }
}

#if defined(__AVX512F__)
// Value sums over two tokens' rows interleaved in 16-bit pairs (unpacklo/hi_epi16) land in lanes out of
// head_dim order: permutex2var of a chunk's two sums with `a` and `b` gives its first and second 16 dims.
struct PairLaneOrder {
  __m512i a, b;
  PairLaneOrder() {
    alignas(64) int32_t order_a[16], order_b[16];
    for (int m = 0; m < 16; ++m) {
      const int j = m % 8;
      order_a[m] = j < 4 ? 4 * (m / 8) + j : 16 + 4 * (m / 8) + j - 4;
      order_b[m] = j < 4 ? 4 * (2 + m / 8) + j : 16 + 4 * (2 + m / 8) + j - 4;
    }
    a = _mm512_load_si512(order_a);
    b = _mm512_load_si512(order_b);
  }
};

// The vector helpers: a transpose-reduce of 16 tokens' partial sums, and exp_shifted 16 scores at a time.
struct ReduceIndex {
  __m512i lo[4], hi[4];
  ReduceIndex() {
    for (int level = 0; level < 4; ++level) {
      const int span = 16 >> level, half = span / 2;  // lanes per token before this level, and after
      alignas(64) int32_t l[16], h[16];
      for (int j = 0; j < 16; ++j) {
        const int jj = j % 8;
        l[j] = (j < 8 ? 0 : 16) + (jj / half) * span + jj % half;
        h[j] = l[j] + half;
      }
      lo[level] = _mm512_load_si512(l);
      hi[level] = _mm512_load_si512(h);
    }
  }
};

// exp(x) of 16 floats (simd_exp.h): a scalar std::exp per score would be a large share of the kernel at large
// batches.
using llmserve::exp16;

// exp_shifted, 16 scores at a time
inline ExpSum exp_shifted16(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - t)) - 1);
    mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, mask, s + t));
  }
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 shift = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), shift)));
    _mm512_mask_storeu_ps(s + t, mask, e);
    sum = _mm512_add_ps(sum, e);
  }
  return {m, _mm512_reduce_add_ps(sum)};
}

// out[t] = sum of the 16 lanes of r[t], for t < 16 (r is overwritten)
inline __m512 transpose_reduce16(__m512* r, const ReduceIndex& ix) {
  for (int level = 0, n = 16; level < 4; ++level, n /= 2)
    for (int i = 0; i < n / 2; ++i)
      r[i] = _mm512_add_ps(_mm512_permutex2var_ps(r[2 * i], ix.lo[level], r[2 * i + 1]),
                           _mm512_permutex2var_ps(r[2 * i], ix.hi[level], r[2 * i + 1]));
  return r[0];
}
#endif  // __AVX512F__

}  // namespace attention
}  // namespace llmserve
