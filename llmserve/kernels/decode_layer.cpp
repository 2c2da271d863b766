// The decoder layers of a small decode step (int4 weights, native kernels throughout) as one call.
//
// Why: at batch 1 the step reads ~95 MB of weights, ~3 ms at this machine's memory rate, yet a compiled
// step took ~4.3 ms. About 1 ms was the calls themselves: per layer four int4 products, K/V write, attention
// and five of Inductor's elementwise loops, each entered from Inductor's Python wrapper (argument checks,
// the dispatcher's boxed path for custom ops, an OpenMP fork). Here the whole stack is one call from Python,
// and each layer's eleven pieces are the same native ops, called through the dispatcher's C++ path: the same
// kernels and the same arithmetic as an eager step on the native kernels (each op in float32 inside,
// rounded once), with the Python between them gone.
//
//   h = rms_norm(x); qkv = h Wqkv (+ b); q, k = rotary(q, k); cache <- k, v; o = attention(q)
//   x = x + o Wo; h = rms_norm(x); x = x + (silu(h Wgate) * h Wup) Wdown
//
// Each linear is int4 or int8 (a K-quant mix such as Q4_K_M: int4 where the file is 4-bit, int8 where it holds
// more bits, Q6_K's in its 6-bit layout), or runs of rows of each (a `StackedLinear`: Q4_K q/k beside a Q6_K v),
// and q/k/v may carry a bias (Qwen2): the layer-by-layer path's kernels and arithmetic for each (a bias added to
// the product in the model's dtype, as `WeightOnlyLinear` adds it).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "attention_common.h"

#include <array>
#include <chrono>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// An op of ours called through the dispatcher's C++ path, its signature written once
template <typename Signature>
struct Op;

template <typename Return, typename... Args>
struct Op<Return(Args...)> {
  explicit Op(const char* name)
      : handle(c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Return(Args...)>()) {}
  Return call(Args... args) const { return handle.call(std::forward<Args>(args)...); }
  c10::TypedOperatorHandle<Return(Args...)> handle;
};

using Tensor = at::Tensor;

struct LayerOps {
  Op<Tensor(const Tensor&, const Tensor&, double)> rms_norm{"llmserve::rms_norm"};
  Op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm{
      "llmserve::add_rms_norm"};
  Op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)> int4_gemv{"llmserve::int4_gemv"};
  Op<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)> int8_gemv{"llmserve::int8_gemv"};
  Op<Tensor(const Tensor&, const Tensor&, const Tensor&)> rotary{"llmserve::rotary"};
  Op<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)> write_kv{"llmserve::write_kv"};
  Op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double)> attention{
      "llmserve::paged_decode_attention"};
  Op<Tensor(const Tensor&)> silu_and_mul{"llmserve::silu_and_mul"};
};

const LayerOps& layer_ops() {
  static const LayerOps ops;  // looked up on first use: every library of ours is registered by then
  return ops;
}

// A linear's small-step weights, one part or more (a `StackedLinear`'s runs of rows, each in its file's format), each
// packed by `pack_int4` (no scales), by `pack_int8` with its row scales or by `pack_int6` (ones); its activations
// split into `activation_parts` int8 parts.
struct LinearPart {
  at::Tensor packed, scales;  // scales undefined: int4
  int64_t activation_parts, out_features;

  at::Tensor operator()(const LayerOps& ops, const at::Tensor& x) const {
    return scales.defined() ? ops.int8_gemv.call(x, packed, scales, out_features, activation_parts)
                            : ops.int4_gemv.call(x, packed, out_features, activation_parts);
  }
};

struct Linear {
  std::vector<LinearPart> parts;

  at::Tensor operator()(const LayerOps& ops, const at::Tensor& x) const {
    if (parts.size() == 1) return parts[0](ops, x);
    std::vector<at::Tensor> outputs;
    for (const auto& part : parts) outputs.push_back(part(ops, x));
    return at::cat(outputs, 1);
  }

  int64_t out_features() const {
    int64_t rows = 0;
    for (const auto& part : parts) rows += part.out_features;
    return rows;
  }
};

// A view of `base`'s memory from element `offset`, made without the dispatcher: a narrow + view pair costs ~0.7 us
// (two dispatched ops, two tensors), this ~0.07, and a layer takes five. `base` must outlive the view: each one here
// views a tensor the layer's call holds.
Tensor view_of(const Tensor& base, int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides) {
  return at::from_blob(static_cast<char*>(base.data_ptr()) + offset * base.element_size(), sizes, strides,
                       base.options());
}

// x [tokens, hidden]; cos, signed_sin [tokens, 1, head_dim]; caches [blocks, kv_heads, block_size, head_dim],
// written at `slots` (one per token and KV head, as write_kv); qkv_bias undefined where q/k/v have none.
struct LayerWeights {
  at::Tensor input_norm;
  Linear qkv;
  at::Tensor qkv_bias;
  Linear o;
  at::Tensor post_norm;
  Linear gate_up, down;
  at::Tensor k_cache, v_cache;
};

// A layer's pieces, in the order it runs them: where a step's time goes, per piece, is what `run_timed` reports
// (benchmarks/bandwidth_ceiling.py), to say what holds a small model's step back from its memory-bandwidth floor.
enum Piece { kInputNorm, kQkv, kRotary, kWriteKv, kAttention, kO, kPostNorm, kGateUp, kGate, kDown, kResidual, kPieces };
const std::array<const char*, kPieces> kPieceNames = {"input norm", "q/k/v", "rotary", "write K/V", "attention", "o",
                                                      "post norm", "gate/up", "gate", "down", "residual"};

// The plain call's timer: nothing, compiled away
struct NoTimer {
  void mark(Piece) {}
};

// Adds the wall time since the last mark to the piece just finished
struct WallTimer {
  using Clock = std::chrono::steady_clock;
  double* seconds;  // [kPieces]
  Clock::time_point last = Clock::now();

  void mark(Piece piece) {
    const auto now = Clock::now();
    seconds[piece] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

template <typename Timer>
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
                        LayerWeights& w, const at::Tensor& slots, const at::Tensor& block_table,
                        const at::Tensor& context_lens, int64_t num_heads, double eps, double scale, Timer& timer) {
  const auto& ops = layer_ops();
  const int64_t tokens = x.size(0);
  const int64_t num_kv_heads = w.k_cache.size(1), head_dim = llmserve::attention::cache_head_dim(w.k_cache);
  const int64_t q_and_k = num_heads + num_kv_heads;
  const at::Tensor h = ops.rms_norm.call(x, w.input_norm, eps);
  timer.mark(kInputNorm);
  at::Tensor qkv = w.qkv(ops, h);  // contiguous: a product's, or their cat
  if (w.qkv_bias.defined()) qkv.add_(w.qkv_bias);  // the product's own output: no copy
  timer.mark(kQkv);
  TORCH_CHECK(qkv.is_contiguous(), "decode_layer: the q/k/v product's output must be contiguous");
  const int64_t row = qkv.size(1);
  const at::Tensor qk = ops.rotary.call(view_of(qkv, 0, {tokens, q_and_k, head_dim}, {row, head_dim, 1}), cos,
                                        signed_sin);
  const at::Tensor v = view_of(qkv, q_and_k * head_dim, {tokens, num_kv_heads, head_dim}, {row, head_dim, 1});
  timer.mark(kRotary);
  ops.write_kv.call(view_of(qk, num_heads * qk.stride(1), {tokens, num_kv_heads, head_dim}, qk.strides()), v,
                    w.k_cache, w.v_cache, slots);
  timer.mark(kWriteKv);
  const at::Tensor attended = ops.attention.call(view_of(qk, 0, {tokens, num_heads, head_dim}, qk.strides()),
                                                 w.k_cache, w.v_cache, block_table, context_lens, scale);
  timer.mark(kAttention);
  TORCH_CHECK(attended.is_contiguous(), "decode_layer: the attention's output must be contiguous");
  const at::Tensor o = w.o(ops, view_of(attended, 0, {tokens, num_heads * head_dim}, {num_heads * head_dim, 1}));
  timer.mark(kO);
  auto [residual, normed] = ops.add_rms_norm.call(x, o, w.post_norm, eps);
  timer.mark(kPostNorm);
  const at::Tensor gate_up = w.gate_up(ops, normed);
  timer.mark(kGateUp);
  const at::Tensor gated = ops.silu_and_mul.call(gate_up);
  timer.mark(kGate);
  const at::Tensor down = w.down(ops, gated);
  timer.mark(kDown);
  residual.add_(down);
  timer.mark(kResidual);
  return residual;
}

// The decoder layers, built once from the model's tensors (shared, not copied) and its KV caches, so a
// step is one call with the step's own tensors only. Four linears per layer (q/k/v, o, gate/up, down), of
// `linear_parts` parts each (one, or a `StackedLinear`'s); `linears`, `linear_scales`, `activation_parts` and
// `part_rows` hold one entry per part (an empty scales tensor for int4; the products' arguments), `qkv_biases`
// one per layer (empty: none).
class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_norms, std::vector<at::Tensor> linears,
              std::vector<at::Tensor> linear_scales, std::vector<at::Tensor> qkv_biases,
              std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches, int64_t num_heads,
              int64_t intermediate_size, double eps, double scale, std::vector<int64_t> activation_parts,
              std::vector<int64_t> linear_parts, std::vector<int64_t> part_rows)
      : num_heads_(num_heads), eps_(eps), scale_(scale) {
    const size_t n = input_norms.size();
    size_t total_parts = 0;
    for (int64_t count : linear_parts) {
      TORCH_CHECK(count >= 1, "DecodeStack: a linear has one part or more");
      total_parts += count;
    }
    TORCH_CHECK(post_norms.size() == n && linear_parts.size() == 4 * n && linears.size() == total_parts &&
                    linear_scales.size() == total_parts && activation_parts.size() == total_parts &&
                    part_rows.size() == total_parts && qkv_biases.size() == n && k_caches.size() == n &&
                    v_caches.size() == n,
                "DecodeStack: one of each tensor per layer (four linears), per linear part");
    size_t next = 0;
    auto linear = [&](size_t i) {
      Linear made;
      for (int64_t p = 0; p < linear_parts[i]; ++p, ++next)
        made.parts.push_back({linears[next], linear_scales[next].numel() ? linear_scales[next] : at::Tensor(),
                              activation_parts[next], part_rows[next]});
      return made;
    };
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(k_caches[i].dim() == 4 && k_caches[i].sizes() == v_caches[i].sizes(),
                  "DecodeStack: caches must be [blocks, kv_heads, block_size, head_dim]");
      LayerWeights layer{input_norms[i], linear(4 * i), qkv_biases[i].numel() ? qkv_biases[i] : at::Tensor(),
                         linear(4 * i + 1), post_norms[i], linear(4 * i + 2), linear(4 * i + 3), k_caches[i],
                         v_caches[i]};
      const int64_t hidden = input_norms[i].numel(), head_dim = llmserve::attention::cache_head_dim(k_caches[i]);
      TORCH_CHECK(layer.qkv.out_features() == (num_heads + 2 * k_caches[i].size(1)) * head_dim &&
                      layer.o.out_features() == hidden && layer.gate_up.out_features() == 2 * intermediate_size &&
                      layer.down.out_features() == hidden,
                  "DecodeStack: a linear's parts must add up to its rows");
      layers_.push_back(std::move(layer));
    }
  }

  // x [tokens, hidden] (the embedded tokens) -> the last layer's output; writes each layer's K/V
  at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin, const at::Tensor& slots,
                 const at::Tensor& block_table, const at::Tensor& context_lens) {
    NoTimer timer;
    return run_layers(x, cos, signed_sin, slots, block_table, context_lens, timer);
  }

  // The same, adding each piece's wall time (summed over the layers) to `seconds` [pieces()], float64
  at::Tensor run_timed(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin,
                       const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& context_lens,
                       const at::Tensor& seconds) {
    TORCH_CHECK(seconds.scalar_type() == at::kDouble && seconds.is_contiguous() && seconds.numel() == kPieces,
                "DecodeStack.run_timed: seconds must be a contiguous float64 tensor of ", kPieces, " elements");
    WallTimer timer{seconds.data_ptr<double>()};
    return run_layers(x, cos, signed_sin, slots, block_table, context_lens, timer);
  }

  // The names of the pieces `run_timed` times, in its order
  static std::vector<std::string> pieces() { return {kPieceNames.begin(), kPieceNames.end()}; }

 private:
  template <typename Timer>
  at::Tensor run_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& signed_sin,
                        const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& context_lens,
                        Timer& timer) {
    TORCH_CHECK(x_in.dim() == 2, "DecodeStack.run: x must be [tokens, hidden]");
    at::Tensor x = x_in;
    for (auto& layer : layers_)
      x = decode_layer(x, cos, signed_sin, layer, slots, block_table, context_lens, num_heads_, eps_, scale_, timer);
    return x;
  }

  std::vector<LayerWeights> layers_;
  int64_t num_heads_;
  double eps_, scale_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, int64_t, int64_t, double, double, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>>())
      .def("run", &DecodeStack::run)
      .def("run_timed", &DecodeStack::run_timed)
      .def_static("pieces", &DecodeStack::pieces);
}
