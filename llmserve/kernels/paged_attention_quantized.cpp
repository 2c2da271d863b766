// Decode attention over a 1-byte KV cache (int8 or fp8 e4m3), and the write that quantizes K/V into it.
//
// Row layout (kv_cache/kv_quant.py): [num_blocks, num_kv_heads, block_size, head_dim + 4] bytes, each
// (token, KV head) row its head_dim values then their float32 scale (x ~= value * scale). A token's
// scale is applied to its score (K) and to its probability (V), never to the values one by one.
//
// int8 on CPUs with AVX512-VNNI: integer dot products, as the bf16 kernel (paged_attention.cpp) uses
// vdpbf16ps, so a token costs about the instructions of a bf16 one while the rows are half the bytes:
//   scores: the query, times the softmax scale, rounded to int16 per query head (scale max|q| / 32767,
//           ~15 bits, finer than the bf16 query of the model dtype path); vpdpwssd multiplies it by the
//           K row sign-extended to int16, exactly, in int32 sums;
//   values: each token's probability times its V scale, rounded to int16 per query head (scale: the
//           largest of them / 32767), against V rows interleaved in pairs as the bf16 kernel does; the
//           int32 sums are moved to float32 every 256 tokens, before they could overflow.
// Other formats and CPUs: a portable loop (each row dequantized to float32).

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>

#include "attention_common.h"

#include <array>
#include <vector>

namespace llmserve {
namespace attention {

namespace {

constexpr int64_t kScaleBytes = 4;

float row_scale(const uint8_t* row, int64_t head_dim) {
  float s;
  std::memcpy(&s, row + head_dim, sizeof(s));
  return s;
}

// float32 values of the 256 fp8 e4m3 bit patterns
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i),
                                                                                  c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

// one row's values as floats (the scale not applied)
template <bool kFp8>
inline void row_values(const uint8_t* row, int64_t head_dim, float* dst) {
  if constexpr (kFp8) {
    const auto& table = fp8_values();
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = table[row[d]];
  } else {
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(static_cast<int8_t>(row[d]));
  }
}

// A 1-byte cache row: its values, and its scale as the factor
template <bool kFp8>
float read_quantized_row(const uint8_t* row, int64_t head_dim, float* dst) {
  row_values<kFp8>(row, head_dim, dst);
  return row_scale(row, head_dim);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kMaxGroup = 8;   // query heads per KV head
constexpr int kMaxChunks = 4;  // head_dim / 32
constexpr int64_t kFlushTokens = 256;  // int32 value sums: 256 * 32767 * 127 < 2^31

// x rounded to int16 steps of max|x| / 32767; returns the step
inline float to_int16(const float* x, int64_t n, int16_t* dst) {
  float mx = 0.f;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, std::fabs(x[i]));
  const float step = mx / 32767.f, inv = mx > 0.f ? 32767.f / mx : 0.f;
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int16_t>(std::nearbyint(x[i] * inv));
  return step;
}

// 32 int8 values sign-extended to int16
inline __m512i widen(const uint8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// G query heads per KV head and C 32-wide chunks of head_dim as template parameters (as the bf16 kernel).
// One task per (sequence, KV head, part of the context); parts' softmax statistics merged at the end.
template <typename T, int G, int C>
void decode_int8_vnni(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_table, const at::Tensor& context_lens, double scale, int64_t window,
                      at::Tensor& out) {
  constexpr int64_t head_dim = 32 * C;
  const int64_t batch = q.size(0), num_heads = q.size(1);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2), width = k_cache.size(3);
  const int64_t max_blocks = block_table.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const auto* k_ptr = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* v_ptr = static_cast<const uint8_t*>(v_cache.data_ptr());
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  static const ReduceIndex reduce_index;
  alignas(64) static const uint8_t zero_row[head_dim + kScaleBytes] = {};
  static const PairLaneOrder lanes;  // value-sum lanes -> head_dim order
  const __m512i perm_a = lanes.a, perm_b = lanes.b;
  const int64_t pairs = batch * num_kv_heads;
  const ContextSplit split = split_contexts(lens, batch, window, block_size);
  const int64_t parts = split.parts;
  constexpr int64_t stride = head_dim + 2;  // max, sum, then the unnormalised V sum
  // not zeroed: every task writes its own (and a zeroing here would pass each line written on another core twice)
  std::unique_ptr<float[]> partial(new float[pairs * parts * G * stride]);

  run_tasks(pairs * parts, [&](auto next_task) {
    std::vector<float> scores, vscales;
    std::vector<int16_t> probs;  // [G][tokens rounded up to even]
    alignas(64) int16_t q16[G][head_dim];
    alignas(64) float qf[head_dim], kscale[16];
    for (int64_t task; (task = next_task()) >= 0;) {
      const PartTask part(task, split, num_kv_heads, lens);
      const int64_t b = part.b, h = part.h, first = part.first, ctx = part.ctx;
      const int64_t ctx2 = (ctx + 1) & ~int64_t(1);
      float* result = partial.get() + task * G * stride;
      if (ctx == 0) {
        PartTask::empty(result, G, stride);
        continue;
      }
      const int32_t* blocks = table + b * max_blocks;
      __m512i qv[G][C];
      float qstep[G];
      for (int g = 0; g < G; ++g) {
        const T* src = q_ptr + (b * num_heads + h * G + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[d] = to_float(src[d]) * fscale;
        qstep[g] = to_int16(qf, head_dim, q16[g]);
        for (int c = 0; c < C; ++c) qv[g][c] = _mm512_load_si512(q16[g] + 32 * c);
      }
      // scores[g][t] = (q_g . k_t) * kscale_t, 16 tokens at a time
      scores.resize(G * ctx);
      RowWalker<uint8_t> k_rows(k_ptr, blocks, h, num_kv_heads, block_size, width, first, first + ctx);
      for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, ctx - t0);
        const uint8_t* krow[16];
        const uint8_t* first_row = n == 16 ? k_rows.run(16) : nullptr;  // a whole chunk in one block
        for (int t = 0; t < 16; ++t) {
          krow[t] = first_row ? first_row + t * width : t < n ? k_rows.next() : zero_row;
          kscale[t] = row_scale(krow[t], head_dim);
        }
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
        const __m512 ks = _mm512_loadu_ps(kscale);
        for (int g = 0; g < G; ++g) {
          __m512 part[16];
          for (int t = 0; t < 16; ++t) {
            __m512i acc = _mm512_setzero_si512();
            for (int c = 0; c < C; ++c) acc = _mm512_dpwssd_epi32(acc, widen(krow[t] + 32 * c), qv[g][c]);
            part[t] = _mm512_cvtepi32_ps(acc);
          }
          _mm512_mask_storeu_ps(scores.data() + g * ctx + t0, mask,
                                _mm512_mul_ps(_mm512_mul_ps(transpose_reduce16(part, reduce_index), ks),
                                              _mm512_set1_ps(qstep[g])));
        }
      }
      // the V rows' scales, then per head: exp, statistics, probabilities * V scale as int16
      vscales.resize(ctx);
      RowWalker<uint8_t> v_scan(v_ptr, blocks, h, num_kv_heads, block_size, width, first, first + ctx);
      for (int64_t t = 0; t < ctx; ++t) vscales[t] = row_scale(v_scan.next(), head_dim);
      probs.assign(G * ctx2, 0);
      float pstep[G];
      for (int g = 0; g < G; ++g) {
        float* s = scores.data() + g * ctx;
        const ExpSum stats = exp_shifted16(s + part.skip, ctx - part.skip);
        std::fill_n(s, part.skip, 0.f);  // before the window
        result[g * stride] = stats.max;
        result[g * stride + 1] = stats.sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= vscales[t];
        pstep[g] = to_int16(s, ctx, probs.data() + g * ctx2);
      }
      // sums[g][d] += p16[g][t] * v_t[d], two tokens per vpdpwssd
      for (int g = 0; g < G; ++g) std::fill(result + g * stride + 2, result + (g + 1) * stride, 0.f);
      RowWalker<uint8_t> v_rows(v_ptr, blocks, h, num_kv_heads, block_size, width, first, first + ctx);
      for (int64_t t1 = 0; t1 < ctx; t1 += kFlushTokens) {
        __m512i acc[G][2 * C];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_setzero_si512();
        const int64_t end = std::min(ctx, t1 + kFlushTokens);
        const uint8_t* chunk = nullptr;  // the current 16 tokens' rows where they lie in one block
        for (int64_t t = t1; t < end; t += 2) {
          if (t % 16 == 0) chunk = ctx - t >= 16 ? v_rows.run(16) : nullptr;
          const uint8_t* v0 = chunk ? chunk + (t % 16) * width : v_rows.next();
          const uint8_t* v1 = chunk ? v0 + width : t + 1 < ctx ? v_rows.next() : zero_row;
          __m512i pp[G];
          for (int g = 0; g < G; ++g) {
            int32_t pair;
            std::memcpy(&pair, probs.data() + g * ctx2 + t, sizeof(pair));
            pp[g] = _mm512_set1_epi32(pair);
          }
          for (int c = 0; c < C; ++c) {
            const __m512i a = widen(v0 + 32 * c), b2 = widen(v1 + 32 * c);
            const __m512i lo = _mm512_unpacklo_epi16(a, b2), hi = _mm512_unpackhi_epi16(a, b2);
            for (int g = 0; g < G; ++g) {
              acc[g][2 * c] = _mm512_dpwssd_epi32(acc[g][2 * c], lo, pp[g]);
              acc[g][2 * c + 1] = _mm512_dpwssd_epi32(acc[g][2 * c + 1], hi, pp[g]);
            }
          }
        }
        for (int g = 0; g < G; ++g) {  // into float32, head_dim order, times the probability step
          float* dst = result + g * stride + 2;
          const __m512 step = _mm512_set1_ps(pstep[g]);
          for (int c = 0; c < C; ++c) {
            const __m512 a = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(acc[g][2 * c], perm_a, acc[g][2 * c + 1]));
            const __m512 b2 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(acc[g][2 * c], perm_b, acc[g][2 * c + 1]));
            _mm512_storeu_ps(dst + c * 32, _mm512_fmadd_ps(a, step, _mm512_loadu_ps(dst + c * 32)));
            _mm512_storeu_ps(dst + c * 32 + 16, _mm512_fmadd_ps(b2, step, _mm512_loadu_ps(dst + c * 32 + 16)));
          }
        }
      }
    }
  }, split.interleaved);

  merge_parts(partial.get(), pairs, parts, G, head_dim, num_kv_heads, out_ptr);
}

template <typename T, int G, int... Cs>
constexpr std::array<DecodeKernel, sizeof...(Cs)> vnni_for_group(std::integer_sequence<int, Cs...>) {
  return {&decode_int8_vnni<T, G, Cs + 1>...};
}

template <typename T, int... Gs>
constexpr auto vnni_table(std::integer_sequence<int, Gs...>) {
  return std::array<std::array<DecodeKernel, kMaxChunks>, sizeof...(Gs)>{
      vnni_for_group<T, Gs + 1>(std::make_integer_sequence<int, kMaxChunks>{})...};
}

// [group - 1][head_dim / 32 - 1], for bf16 and float32 queries
constexpr auto kVnniBf16 = vnni_table<c10::BFloat16>(std::make_integer_sequence<int, kMaxGroup>{});
constexpr auto kVnniFloat = vnni_table<float>(std::make_integer_sequence<int, kMaxGroup>{});
#endif

// x [head_dim] -> row: values rounded half to even after x * (1 / scale), scale = max|x| * (1 / largest), as
// kv_quant.quantize_rows computes them
template <typename T, bool kFp8>
inline void quantize_row(const T* x, int64_t head_dim, uint8_t* row) {
  constexpr float largest = kFp8 ? 448.f : 127.f;
  float mx = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) mx = std::max(mx, std::fabs(to_float(x[d])));
  float scale = mx * (1.f / largest);
  // a barrier: under -ffast-math the compiler would otherwise rewrite 1 / (mx / largest) as largest / mx,
  // which rounds differently from the PyTorch path's reciprocal of the stored scale
  asm volatile("" : "+x"(scale));
  const float inv = 1.f / (scale > 0.f ? scale : 1.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    const float v = to_float(x[d]) * inv;
    if constexpr (kFp8) {
      row[d] = c10::Float8_e4m3fn(std::clamp(v, -largest, largest)).x;
    } else {
      row[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(v), -largest, largest)));
    }
  }
  std::memcpy(row + head_dim, &scale, sizeof(scale));
}

}  // namespace

bool is_quantized_cache(const at::Tensor& cache) {
  return cache.scalar_type() == at::kChar || cache.scalar_type() == at::kFloat8_e4m3fn;
}

int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(3) - (is_quantized_cache(cache) ? kScaleBytes : 0);
}

at::Tensor decode_quantized(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& context_lens, double scale,
                            int64_t window) {
  at::Tensor out = at::empty_like(q);
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const int64_t group = q.size(1) / k_cache.size(1), head_dim = q.size(2);
  if (!fp8 && group <= kMaxGroup && head_dim % 32 == 0 && head_dim / 32 <= kMaxChunks &&
      (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat)) {
    const auto& kernels = q.scalar_type() == at::kBFloat16 ? kVnniBf16 : kVnniFloat;
    kernels[group - 1][head_dim / 32 - 1](q, k_cache, v_cache, block_table, context_lens, scale, window, out);
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_quantized", [&] {
    if (fp8)
      decode_portable<scalar_t, uint8_t>(q, k_cache, v_cache, block_table, context_lens, scale, window, out,
                                         read_quantized_row<true>);
    else
      decode_portable<scalar_t, uint8_t>(q, k_cache, v_cache, block_table, context_lens, scale, window, out,
                                         read_quantized_row<false>);
  });
  return out;
}

void write_quantized(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     const int64_t* slots, int64_t rows) {
  const int64_t head_dim = k.size(2), width = k_cache.size(3);
  auto* kd = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vd = static_cast<uint8_t*>(v_cache.data_ptr());
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_quantized", [&] {
    const scalar_t* ks = k.data_ptr<scalar_t>();
    const scalar_t* vs = v.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      if (fp8) {
        quantize_row<scalar_t, true>(ks + r * head_dim, head_dim, kd + slots[r] * width);
        quantize_row<scalar_t, true>(vs + r * head_dim, head_dim, vd + slots[r] * width);
      } else {
        quantize_row<scalar_t, false>(ks + r * head_dim, head_dim, kd + slots[r] * width);
        quantize_row<scalar_t, false>(vs + r * head_dim, head_dim, vd + slots[r] * width);
      }
    }
  });
}

}  // namespace attention
}  // namespace llmserve
