// The bulk of the packed weight layouts `quantized_gemv.py` builds (`pack_int4`'s nibbles, `pack_int6`'s nibbles and
// top bits), written in one pass from the levels; the small per-group headers stay in PyTorch.
//
// Why: PyTorch made each a chain of whole-weight temporaries (mask, shift, or, a permuted copy; six shifted copies
// summed for the top bits), seconds of a larger model's start (docs/performance.md, "Start-up"). The bytes are
// the ones those ops give (tests/kernels/test_pack_layouts.py):
//   int4: out[block, group, 64 c + 4 r + s] = q[16 block + r, 32 group + 8 c + s]
//                                            | q[16 block + r, 32 group + 8 c + 4 + s] << 4;
//   int6: the same nibbles of q & 15 in bytes 0-255 of a group, then in bytes 256-383
//         [64 v + 4 r + s] = OR over c2, h of (q[16 block + r, 32 group + 16 v + 8 c2 + 4 h + s] >> 4) << 2 (2 c2 + h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kRows = 16, kGroup = 32;

void check_levels(const at::Tensor& q, const char* op) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(), op,
              ": the levels must be a contiguous uint8 [out, in] tensor");
  TORCH_CHECK(q.size(0) % kRows == 0 && q.size(1) % kGroup == 0, op, ": out_features must be a multiple of ", kRows,
              " and in_features of ", kGroup);
}

// one group's 256 nibble bytes of one row block (levels masked to their low 4 bits)
inline void nibble_bytes(const uint8_t* q, int64_t in, uint8_t* out) {
  for (int r = 0; r < kRows; ++r) {
    const uint8_t* row = q + r * in;
    for (int c = 0; c < 4; ++c) {
      for (int s = 0; s < 4; ++s) {
        out[64 * c + 4 * r + s] = static_cast<uint8_t>((row[8 * c + s] & 15) | ((row[8 * c + 4 + s] & 15) << 4));
      }
    }
  }
}

template <typename Group>
at::Tensor per_group(const at::Tensor& q, int64_t group_bytes, const Group& group) {
  const int64_t blocks = q.size(0) / kRows, groups = q.size(1) / kGroup, in = q.size(1);
  at::Tensor out = at::empty({blocks, groups, group_bytes}, q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t g = 0; g < groups; ++g) {
        group(src + b * kRows * in + g * kGroup, in, dst + (b * groups + g) * group_bytes);
      }
    }
  });
  return out;
}

at::Tensor int4_nibbles(const at::Tensor& q) {
  check_levels(q, "int4_nibbles");
  return per_group(q, 256, [](const uint8_t* levels, int64_t in, uint8_t* out) { nibble_bytes(levels, in, out); });
}

at::Tensor int6_group_bytes(const at::Tensor& q) {
  check_levels(q, "int6_group_bytes");
  return per_group(q, 384, [](const uint8_t* levels, int64_t in, uint8_t* out) {
    nibble_bytes(levels, in, out);
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* row = levels + r * in;
      for (int v = 0; v < 2; ++v) {
        for (int s = 0; s < 4; ++s) {
          uint8_t top = 0;
          for (int c2 = 0; c2 < 2; ++c2) {
            for (int h = 0; h < 2; ++h) top |= (row[16 * v + 8 * c2 + 4 * h + s] >> 4) << (2 * (2 * c2 + h));
          }
          out[256 + 64 * v + 4 * r + s] = top;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("int4_nibbles(Tensor q) -> Tensor");
  m.def("int6_group_bytes(Tensor q) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("int4_nibbles", &int4_nibbles);
  m.impl("int6_group_bytes", &int6_group_bytes);
}
