// GGML's block formats decoded to float32 in one pass per block (`loader/ggml_blocks.py` calls it when the kernels
// are loaded, and keeps its PyTorch decoders otherwise).
//
// Why: the PyTorch decoders take several passes over each chunk (nibbles, shifts, masks, products), a large share
// of a larger model's start (Qwen2.5-Coder-1.5B with its draft: 1.8 G values; docs/performance.md, "Start-up").
//
// Each format does the `gguf` package's float32 arithmetic in its order, as the PyTorch decoders do (IEEE, no
// fused multiply-add): the values are the package's bit for bit (tests/loader/test_ggml_blocks.py, both paths).
// Block layouts (bytes): Q4_0 d | 16 nibble bytes; Q4_1 d m | 16; Q5_0 d | 4 high-bit bytes | 16; Q5_1 d m | 4 | 16;
// Q8_0 d | 32 int8; Q4_K d dmin | 12 bytes of 6-bit scales and minima | 128 nibble bytes; Q5_K the same with 32
// high-bit bytes before the nibbles; Q6_K 128 low-nibble bytes | 64 bytes of 2-bit tops | 16 int8 scales | d.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "elementwise.h"

#include <cstdint>

namespace {


// GGMLQuantizationType's values
enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

LLMSERVE_IEEE_LOOPS float fp16_at(const uint8_t* b, int offset) {
  return c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(b[offset] | (b[offset + 1] << 8)));
}

// the 32 values of a 16-byte nibble run: low nibbles first, then high ones
LLMSERVE_IEEE_LOOPS inline void nibbles32(const uint8_t* q, uint8_t* out) {
  for (int i = 0; i < 16; ++i) {
    out[i] = q[i] & 15;
    out[i + 16] = q[i] >> 4;
  }
}

// bit i of four little-endian bytes, for the 32 values
LLMSERVE_IEEE_LOOPS inline void high_bits32(const uint8_t* h, uint8_t* out) {
  for (int i = 0; i < 32; ++i) out[i] = (h[i / 8] >> (i % 8)) & 1;
}

// value = (q - offset) * d, or q * d + m (two roundings)
LLMSERVE_IEEE_LOOPS void scaled(const uint8_t* q, int offset, float d, float* out) {
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int>(q[i]) - offset) * d;
}
LLMSERVE_IEEE_LOOPS void scaled_plus(const uint8_t* q, float d, float m, float* out) {
  for (int i = 0; i < 32; ++i) {
    const float product = static_cast<float>(q[i]) * d;
    out[i] = product + m;
  }
}
// value = q * d - m (two roundings)
LLMSERVE_IEEE_LOOPS void scaled_minus(const uint8_t* q, float d, float m, float* out) {
  for (int i = 0; i < 32; ++i) {
    const float product = static_cast<float>(q[i]) * d;
    out[i] = product - m;
  }
}

// Q4_K / Q5_K: group j's 6-bit scale and minimum (gguf's Q4_K.get_scale_min)
LLMSERVE_IEEE_LOOPS inline void scale_min_k(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

LLMSERVE_IEEE_LOOPS void decode_block(int64_t format, const uint8_t* b, float* out) {
  uint8_t q[32];
  switch (format) {
    case kQ4_0:
      nibbles32(b + 2, q);
      return scaled(q, 8, fp16_at(b, 0), out);
    case kQ4_1:
      nibbles32(b + 4, q);
      return scaled_plus(q, fp16_at(b, 0), fp16_at(b, 2), out);
    case kQ5_0:
    case kQ5_1: {
      const bool with_min = format == kQ5_1;
      uint8_t high[32];
      high_bits32(b + (with_min ? 4 : 2), high);
      nibbles32(b + (with_min ? 8 : 6), q);
      for (int i = 0; i < 32; ++i) q[i] |= high[i] << 4;
      return with_min ? scaled_plus(q, fp16_at(b, 0), fp16_at(b, 2), out) : scaled(q, 16, fp16_at(b, 0), out);
    }
    case kQ8_0: {
      const float d = fp16_at(b, 0);
      const int8_t* v = reinterpret_cast<const int8_t*>(b + 2);
      for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(v[i]) * d;
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool five = format == kQ5_K;
      const float d = fp16_at(b, 0), dmin = fp16_at(b, 2);
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {  // group j: the low (even j) or high nibbles of 32-byte run j / 2
        int sc, mn;
        scale_min_k(b + 4, j, sc, mn);
        const float group_d = d * static_cast<float>(sc), group_m = dmin * static_cast<float>(mn);
        const uint8_t* run = qs + 32 * (j / 2);
        for (int i = 0; i < 32; ++i) q[i] = j % 2 ? run[i] >> 4 : run[i] & 15;
        if (five) {
          for (int i = 0; i < 32; ++i) q[i] |= ((b[16 + i] >> j) & 1) << 4;
        }
        scaled_minus(q, group_d, group_m, out + 32 * j);
      }
      return;
    }
    case kQ6_K: {
      const float d = fp16_at(b, 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      for (int j = 0; j < 8; ++j) {  // values 32j ..: run r = j / 4 of 128
        const int r = j / 4, within = (j % 4) * 32;
        const uint8_t* low = b + 64 * r + within % 64;
        const uint8_t* top = b + 128 + 32 * r;
        const int low_shift = within < 64 ? 0 : 4, top_shift = 2 * (j % 4);
        for (int i = 0; i < 32; ++i) q[i] = ((low[i] >> low_shift) & 15) | (((top[i] >> top_shift) & 3) << 4);
        for (int half = 0; half < 2; ++half) {
          const float group_d = d * static_cast<float>(scales[2 * j + half]);
          for (int i = 0; i < 16; ++i) {
            out[32 * j + 16 * half + i] = static_cast<float>(static_cast<int>(q[16 * half + i]) - 32) * group_d;
          }
        }
      }
      return;
    }
    default:
      TORCH_CHECK(false, "ggml_dequantize: format ", format, " is not decoded here");
  }
}

int64_t block_values(int64_t format) {
  return format == kQ4_K || format == kQ5_K || format == kQ6_K ? 256 : 32;
}

int64_t block_bytes(int64_t format) {
  switch (format) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: TORCH_CHECK(false, "ggml_dequantize: format ", format, " is not decoded here");
  }
}

at::Tensor ggml_dequantize(const at::Tensor& blocks, int64_t format) {
  const int64_t bytes = block_bytes(format), values = block_values(format);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) == bytes &&
                  blocks.is_contiguous(),
              "ggml_dequantize: blocks must be contiguous uint8 [n, ", bytes, "] for format ", format);
  at::Tensor out = at::empty({blocks.size(0), values}, blocks.options().dtype(at::kFloat));
  const uint8_t* b = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, blocks.size(0), std::max<int64_t>(1, 4096 / values), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) decode_block(format, b + i * bytes, o + i * values);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) { m.def("ggml_dequantize(Tensor blocks, int format) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("ggml_dequantize", &ggml_dequantize); }
