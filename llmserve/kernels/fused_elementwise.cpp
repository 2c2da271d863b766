// The decoder layer's elementwise work as four ops, for the steps that run eagerly (prompts, and a busy
// server's steps that prefill one request beside the decodes). Eager PyTorch spends ~25 small kernels a
// layer on RMSNorm (casts, square, mean, rsqrt, products), rotary (two products, a roll, a sum) and the
// SwiGLU gate (a slow bf16 SiLU, a product): a large share of a busy server's mixed step, nearly all of it
// dispatch and OpenMP wake-ups. Each op here reads its inputs once and writes once, in float32 inside,
// rounding to the tensor's dtype only at the end (as Inductor's fused loops do; eager rounds after every
// op). The compiled decode graph does not use them: Inductor fuses the same ops there itself. What they save
// in mixed and eager steps: docs/performance.md, "Prefix caching and chunked prefill".
//
//   rms_norm(x, w, eps, unit_offset)     w * x / sqrt(mean(x^2) + eps), per row (1 + w: Gemma's); x [tokens,
//                                        features], or [tokens, heads, head_dim] for query/key norms
//   add_rms_norm(x, d, w, eps, unit_offset)  (x + d, rms_norm(x + d)): the residual add and the next norm in one pass
//   rotary(x, cos, signed_sin)           x * cos + roll(x, head_dim / 2) * signed_sin, per head (rotate-half RoPE)
//   silu_and_mul(gate_up)                silu(gate) * up, the two halves of the fused gate/up projection
//   gelu_tanh_and_mul(gate_up)           gelu(gate) * up, GELU's tanh approximation (Gemma)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "elementwise.h"

#include <tuple>

namespace {

using namespace llmserve::elementwise;  // the rows (elementwise.h)

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [tokens, features] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only (other dtypes take the PyTorch path)");
}

template <typename F>
void dispatch_dtype(const at::Tensor& x, const at::Tensor& w, F&& body) {
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "a float32 x needs a float32 weight");
    body(float{}, float{});
  } else if (w.scalar_type() == at::kFloat) {
    body(at::BFloat16{}, float{});
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "weight must be float32 or bfloat16");
    body(at::BFloat16{}, at::BFloat16{});
  }
}

// x [tokens, features], or [tokens, heads, head_dim] with each token's heads contiguous (a query/key norm over the
// fused q/k/v projection's columns): the output is contiguous
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight_in, double eps, bool unit_offset) {
  const bool heads = x.dim() == 3;
  TORCH_CHECK(!heads || (x.stride(2) == 1 && x.stride(1) == x.size(2)),
              "rms_norm: x [tokens, heads, head_dim] must have each token's heads contiguous");
  check_rows(heads ? x.select(1, 0) : x, "rms_norm");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t per_token = heads ? x.size(1) : 1, rows = x.size(0) * per_token, n = x.size(-1);
  TORCH_CHECK(weight.numel() == n, "rms_norm: one weight per feature");
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_dtype(x, weight, [&](auto t, auto wt) {
    using T = decltype(t);
    using W = decltype(wt);
    const T* xp = x.data_ptr<T>();
    const W* wp = weight.data_ptr<W>();
    T* op = out.data_ptr<T>();
    const int64_t ld = x.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<T, W>(xp + r / per_token * ld + r % per_token * n, nullptr, wp, op + r * n, nullptr, n,
                           static_cast<float>(eps), unit_offset);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& delta_in,
                                                const at::Tensor& weight_in, double eps, bool unit_offset) {
  const at::Tensor x = x_in.contiguous(), delta = delta_in.contiguous(), weight = weight_in.contiguous();
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and delta must have the same shape and dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n, "add_rms_norm: one weight per feature");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  dispatch_dtype(x, weight, [&](auto t, auto wt) {
    using T = decltype(t);
    using W = decltype(wt);
    const T *xp = x.data_ptr<T>(), *dp = delta.data_ptr<T>();
    const W* wp = weight.data_ptr<W>();
    T *sp = sum.data_ptr<T>(), *op = out.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<T, W>(xp + r * n, dp + r * n, wp, op + r * n, sp + r * n, n, static_cast<float>(eps),
                           unit_offset);
    });
  });
  return {sum, out};
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x must be [tokens, heads, head_dim] with each row's heads contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotary: float32 or bfloat16 only");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0, "rotary: head_dim must be even");
  const at::Tensor cos = cos_in.to(x.scalar_type()).contiguous(), sin = sin_in.to(x.scalar_type()).contiguous();
  TORCH_CHECK(cos.numel() == rows * d && sin.numel() == rows * d, "rotary: one cos and sin row per token");
  at::Tensor out = at::empty({rows, heads, d}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rotary_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(), rows,
                heads, d, x.stride(0));
  } else {
    rotary_rows(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), rows, heads, d, x.stride(0));
  }
  return out;
}

// A gated activation's op over its rows (`Rows`: silu_and_mul_rows or gelu_tanh_and_mul_rows)
template <typename Rows>
at::Tensor gate_and_mul(const at::Tensor& x, const char* op, Rows rows_of) {
  check_rows(x, op);
  TORCH_CHECK(x.size(1) % 2 == 0, op, ": x must be [tokens, 2 * features]");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rows_of(x.data_ptr<float>(), out.data_ptr<float>(), rows, n, x.stride(0));
  } else {
    rows_of(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n, x.stride(0));
  }
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  return gate_and_mul(x, "silu_and_mul", [](const auto* in, auto* out, int64_t rows, int64_t n, int64_t ld) {
    silu_and_mul_rows(in, out, rows, n, ld);
  });
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return gate_and_mul(x, "gelu_tanh_and_mul", [](const auto* in, auto* out, int64_t rows, int64_t n, int64_t ld) {
    gelu_tanh_and_mul_rows(in, out, rows, n, ld);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset=False) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, bool unit_offset=False) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
}
