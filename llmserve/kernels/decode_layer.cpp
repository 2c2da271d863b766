// The decoder layers of a decode step (int4 weights, native kernels throughout) as one call: from the tokens'
// embedding rows to the final norm.
//
// Why: at batch 1 the step reads ~95 MB of weights (SmolLM2), yet a compiled step lost a good share of its time
// to the calls themselves rather than to that stream: per layer four int4 products, K/V write, attention
// and five of Inductor's elementwise loops, each entered from Inductor's Python wrapper (argument checks,
// the dispatcher's boxed path for custom ops, an OpenMP fork; docs/performance.md, "The one-call decode step").
// Here the whole stack is one call from Python:
// the products and the attention are our kernels, called through their C++ entry points into the step's buffers
// (no dispatcher, no allocation); the norms, rotary, the K/V write and the gate run in place on those buffers
// through the rows the eager ops use (elementwise.h), a layer's residual add joined to the next layer's norm. The
// same kernels and the same arithmetic as an eager step on the native kernels (each piece in float32 inside, rounded
// once), bit for bit.
//
//   h = rms_norm(x); qkv = h Wqkv (+ b); q, k = rotary(q, k); cache <- k, v; o = attention(q)
//   x = x + o Wo; h = rms_norm(x); x = x + (silu(h Wgate) * h Wup) Wdown
//
// and what other dense families add to that layer, each a field of the model or of a layer (models/fused_stack.py
// names them from the model's description): norms that scale by 1 + w (Gemma), a norm over each query and key head
// before rotary (Qwen3, Gemma 3), sandwich norms (Gemma 3: the attention's and the MLP's outputs normed before their
// residual adds, the MLP's input by a norm of its own), a tanh-GELU gate, scaled embeddings, a sliding window per
// layer (Mistral, Phi-3, Gemma 3's local layers) and a second rotary table for windowed layers (Gemma 3); and
// experts in place of the MLP (Mixtral, Qwen2-MoE: `Experts`, the eager block's ops in its order).
//
// Each linear is int4 or int8 (a K-quant mix such as Q4_K_M: int4 where the file is 4-bit, int8 where it holds
// more bits, Q6_K's in its 6-bit layout), or runs of rows of each (a `StackedLinear`: Q4_K q/k beside a Q6_K v),
// and q/k/v may carry a bias (Qwen2): the layer-by-layer path's kernels and arithmetic for each (a bias added to
// the product in the model's dtype, as `WeightOnlyLinear` adds it).
//
// Larger decode steps (a busy server's batch) run here too (`LargeStep`): past its small-step kernel's tokens each part
// takes the layers' large-step product through the ops the layers call (int8 x int8 on the step's quantized
// activations, or the dense product of the quantized values), so the same bits again; the rest of the layer is the
// same code at any size.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "attention_common.h"
#include "elementwise.h"
#include "team.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace llmserve::gemv {  // quantized_gemv.cpp: the products into a caller's output
void int4_gemv_out(const at::Tensor& x, const at::Tensor& packed, int64_t activation_parts, at::Tensor& out);
void int8_gemv_out(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t activation_parts,
                   at::Tensor& out);
}  // namespace llmserve::gemv

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
  Op<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)> write_kv{"llmserve::write_kv"};
};

const LayerOps& layer_ops() {
  static const LayerOps ops;  // looked up on first use: every library of ours is registered by then
  return ops;
}

// The large steps' products (int8_activations.py, layers/linear.py), looked up at the first large step: a stack
// without them never needs oneDNN's ops registered
struct LargeStepOps {
  Op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&)> quantize{"llmserve::quantize_activations_u8"};
  // (its kernel's registered signature, by value, as the typed handle requires)
  Op<Tensor(Tensor, double, int64_t, Tensor, Tensor, Tensor, std::optional<Tensor>, double, int64_t,
            std::optional<at::ScalarType>, c10::string_view, c10::List<std::optional<at::Scalar>>, c10::string_view)>
      qlinear{"onednn::qlinear_pointwise"};
  Op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, at::ScalarType)> amx{
      "llmserve::int8_gemm"};
  Op<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>
      packed_dense{"mkldnn::_linear_pointwise"};
};

const LargeStepOps& large_step_ops() {
  static const LargeStepOps ops;
  return ops;
}

// A part's product for steps past its small-step kernel, as the layer computes it, through the same ops in the same
// order (so the same bits):
// - kDense: the quantized values in the model's dtype (`weight`: oneDNN's packed copy, or the plain one where it has
//   none), the bias inside the product, as `layers.linear.dense_linear` multiplies;
// - kOneDnn, kAmx: int8 activations (one scale a token, after SmoothQuant's `smooth_inv`) times the smoothed int8
//   weight, as `WeightOnlyLinear.int8_forward`: oneDNN's (`weight` prepacked, `extra` its zero points) or our AMX
//   kernel's (`weight` in its layout, `extra` its compensation); the bias added after.
// Why here too: layer by layer a large step spends a good share of its time between its ops, which a compiled
// graph saves only after a long compile (docs/performance.md, "The one-call decode step").
// - kNone: none; the part's own kernel takes every step (its `small_max_tokens` is the largest int64), so a token's
//   product has the same bits whatever the step holds, and no second copy of the weight is kept.
// Returns the tensor that holds the product: `out`, or the op's own output where the op allocates one (copying it
// into `out` would cost a pass over it; the layer reads whichever it gets).
enum LargeStepKind : int64_t { kDense = 0, kOneDnn = 1, kAmx = 2, kNone = 3 };

struct LargeStep {
  int64_t kind = kDense;
  at::Tensor smooth_inv, weight, scales, extra;

  at::Tensor operator()(const at::Tensor& x, const at::Tensor& bias, at::Tensor& out) const {
    const auto& ops = large_step_ops();
    const std::optional<at::Tensor> maybe_bias = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
    if (kind == kDense)
      return weight.is_mkldnn() ? ops.packed_dense.call(x, weight, maybe_bias, "none",
                                                            c10::List<std::optional<at::Scalar>>(), "")
                                : at::linear(x, weight, maybe_bias);
    const auto [xu, row_scales] = ops.quantize.call(x, smooth_inv);
    at::Tensor y;
    if (kind == kAmx) {
      y = ops.amx.call(xu, row_scales, weight, scales, extra, x.scalar_type());
    } else {
      const at::Tensor y32 = ops.qlinear.call(xu, 1.0, 128, weight, scales, extra, std::nullopt, 1.0, 0, at::kFloat,
                                              "none", c10::List<std::optional<at::Scalar>>(), "");
      TORCH_CHECK(y32.is_contiguous() && out.is_contiguous(), "DecodeStack.run: a product's rows must be contiguous");
      AT_DISPATCH_SWITCH(out.scalar_type(), "DecodeStack.large_step",
                         AT_DISPATCH_CASE(at::kFloat, [&] {
                           llmserve::elementwise::scale_rows(y32.data_ptr<float>(), row_scales.data_ptr<float>(),
                                                             out.data_ptr<float>(), y32.size(0), y32.size(1));
                         }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           llmserve::elementwise::scale_rows(y32.data_ptr<float>(), row_scales.data_ptr<float>(),
                                                             out.data_ptr<at::BFloat16>(), y32.size(0), y32.size(1));
                         }));
      y = out;
    }
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

// A linear's weights, one part or more (a `StackedLinear`'s runs of rows, each in its file's format), each with its
// rows of the bias (undefined: none). Steps up to `small_max_tokens` take the small-step kernel: weights packed by
// `pack_int4` (no scales), by `pack_int8` with its row scales or by `pack_int6` or `pack_int8_grouped` (ones);
// activations split into `activation_parts` int8 parts; the bias added after, as `WeightOnlyLinear` adds it. Larger
// steps take the large-step product. The small-step kernels write into the step's buffer (`out`, [tokens,
// out_features]) through their own entry points, not the dispatcher: a dispatched product allocates its output, a
// good share of what a call costs beside its weights (docs/performance.md, "The one-call decode step"). Returns the
// tensor holding the product (see LargeStep).
struct LinearPart {
  at::Tensor packed, scales, bias;  // scales undefined: int4
  int64_t activation_parts, out_features, small_max_tokens;
  LargeStep large;

  at::Tensor operator()(const at::Tensor& x, at::Tensor& out) const {
    if (x.size(0) > small_max_tokens) {
      at::Tensor y = large(x, bias, out);
      TORCH_CHECK(y.is_contiguous() && y.scalar_type() == out.scalar_type() && y.sizes() == out.sizes(),
                  "DecodeStack.run: a large step's product must be contiguous [tokens, rows] in the step's dtype");
      return y;
    }
    if (scales.defined())
      llmserve::gemv::int8_gemv_out(x, packed, scales, activation_parts, out);
    else
      llmserve::gemv::int4_gemv_out(x, packed, activation_parts, out);
    if (bias.defined()) out.add_(bias);
    return out;
  }
};

struct Linear {
  std::vector<LinearPart> parts;

  at::Tensor operator()(const at::Tensor& x, at::Tensor& out) const {
    if (parts.size() == 1) return parts[0](x, out);
    std::vector<at::Tensor> outputs;  // each part's rows of every token: side by side in out's rows
    for (const auto& part : parts) {
      at::Tensor own = at::empty({x.size(0), part.out_features}, x.options());
      outputs.push_back(part(x, own));
    }
    at::cat_out(out, outputs, 1);
    return out;
  }

  int64_t out_features() const {
    int64_t rows = 0;
    for (const auto& part : parts) rows += part.out_features;
    return rows;
  }
};

// A view of `base`'s memory from element `offset`, made without the dispatcher: a narrow + view pair is two
// dispatched ops and two tensors, this neither. `base` must outlive the view: each one here views a tensor the
// layer's call holds.
Tensor view_of(const Tensor& base, int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides) {
  return at::from_blob(static_cast<char*>(base.data_ptr()) + offset * base.element_size(), sizes, strides,
                       base.options());
}

// the gated MLP's activation, as models/fused_stack.py names it
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// act(gate) * up over `rows` rows of a fused gate/up product (`ld` apart), into `out` [rows, n]
template <typename T>
void gate_rows(int64_t activation, const T* gate_up, T* out, int64_t rows, int64_t n, int64_t ld) {
  if (activation == kGeluTanh)
    llmserve::elementwise::gelu_tanh_and_mul_rows(gate_up, out, rows, n, ld);
  else
    llmserve::elementwise::silu_and_mul_rows(gate_up, out, rows, n, ld);
}

// One expert (or a shared expert): a gated MLP on the rows routed to it, each product into a tensor of its own
// (an expert's rows are a step's few, not worth carving buffers for)
struct ExpertMlp {
  Linear gate_up, down;

  template <typename T>
  at::Tensor run(const at::Tensor& x, int64_t activation) const {
    const int64_t rows = x.size(0), inter = gate_up.out_features() / 2;
    at::Tensor product = at::empty({rows, 2 * inter}, x.options());
    const at::Tensor both = gate_up(x, product);
    at::Tensor gated = at::empty({rows, inter}, x.options());
    gate_rows<T>(activation, static_cast<const T*>(both.data_ptr()), gated.data_ptr<T>(), rows, inter, 2 * inter);
    at::Tensor out = at::empty({rows, down.out_features()}, x.options());
    return down(gated, out);
  }
};

// A mixture of experts in place of the MLP (layers/moe.py's `SparseMoE`): the router and the shared expert's gate in
// the model's dtype, the experts' linears as any layer's
struct Experts {
  at::Tensor router;  // [experts, hidden] (undefined: a dense layer)
  at::Tensor shared_gate;  // [1, hidden] (undefined: no shared expert)
  std::vector<ExpertMlp> experts;
  ExpertMlp shared;
};

// caches [blocks, kv_heads, block_size, head_dim], written at a step's `slots` (one per token and KV head, as
// write_kv)
struct LayerWeights {
  at::Tensor input_norm;
  Linear qkv;  // with its bias, where q/k/v have one
  at::Tensor q_norm, k_norm;  // each head's norm before rotary (undefined: none)
  Linear o;
  // the norm after attention: the MLP's input's, or (sandwich norms, `pre_feedforward_norm` defined) the attention
  // output's, before its residual add; then `post_feedforward_norm` of the MLP's output
  at::Tensor post_norm, pre_feedforward_norm, post_feedforward_norm;
  Linear gate_up, down;  // the dense MLP (no parts: experts)
  Experts moe;
  at::Tensor k_cache, v_cache;
  int64_t window = 0;  // sliding window in tokens, 0: the whole context
  int64_t rope = 0;  // which rotary table: 0 the model's, 1 the windowed layers' own

  bool sparse() const { return moe.router.defined(); }
};

// A layer's pieces, in the order it runs them: where a step's time goes, per piece, is what `run_timed` reports
// (benchmarks/bandwidth_ceiling.py), to say what holds a small model's step back from its memory-bandwidth floor.
// A layer's input norm takes the residual add of the layer before it; the last layer's add is the final norm's.
enum Piece { kInputNorm, kQkv, kRotary, kAttention, kO, kPostNorm, kGateUp, kGate, kDown, kFinalNorm, kPieces };
const std::array<const char*, kPieces> kPieceNames = {"input norm", "q/k/v", "rotary, K/V write", "attention", "o",
                                                      "post norm", "gate/up", "gate", "down", "final norm"};

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

// A step's own tensors, checked once for all its layers, and the buffers every piece writes into: one allocation a
// step, its tensors made once for all layers. The norms, rotary, the K/V write and the gate run in place on these
// through the rows of elementwise.h (the eager ops' own code, so the same bits): dispatched, each would allocate its
// output (docs/performance.md, "The one-call decode step"); the products and the attention write into theirs.
template <typename T>
struct Step {
  int64_t tokens, hidden, intermediate, num_heads, num_kv_heads, head_dim;
  double eps, scale;  // the norms' epsilon, the attention's scale
  bool unit_offset;  // norms scale by 1 + w
  int64_t activation;  // an `Activation`
  int64_t top_k;  // experts a token takes
  bool normalize_top_k;  // their weights renormalized to sum to 1
  std::array<const T*, 2> cos, sin;  // [tokens, head_dim] of each rotary table (a layer's `rope` picks)
  const int64_t* slots;  // [tokens * num_kv_heads]
  bool plain_slots;  // the caches hold the model's dtype: the K/V write is a copy per slot
  at::Tensor slots_tensor, block_table, context_lens;
  at::Tensor buffers;
  T *residual, *normed, *qk, *gated;  // [tokens, hidden] x 2, [tokens, q + k heads, head_dim], [tokens, intermediate]
  T* qk_normed;  // query/key norms: q and k heads normed, before rotary [tokens, q + k heads, head_dim]
  T* block_out;  // sandwich norms: a block's output normed [tokens, hidden]
  // over the buffers: the products' inputs and outputs, the attention's queries (rotated, in `qk`) and output
  at::Tensor normed_rows, gated_rows, qkv, queries, attended, attended_rows, o, gate_up, down;

  int64_t q_and_k() const { return num_heads + num_kv_heads; }
};

// rms_norm of `rows` rows of `a` (+ `b`, the sum kept in `sum_out`: the residual stream) into `out`; rows `lda`
// apart in `a` (0: `n`)
template <typename T>
void norm_rows(const T* a, const T* b, const at::Tensor& weight, T* out, T* sum_out, int64_t rows, int64_t n,
               double eps, bool unit_offset, int64_t lda = 0) {
  lda = lda ? lda : n;
  auto each = [&](const auto* w) {
    for (int64_t r = 0; r < rows; ++r)
      llmserve::elementwise::rms_norm_row(a + r * lda, b ? b + r * n : nullptr, w, out + r * n,
                                          sum_out ? sum_out + r * n : nullptr, n, static_cast<float>(eps),
                                          unit_offset);
  };
  if (weight.scalar_type() == at::kFloat)
    each(weight.data_ptr<float>());
  else
    each(weight.data_ptr<at::BFloat16>());
}

// Asks for a small tensor's lines ahead of the piece that reads it (a norm's weights: the products' weight streams
// between two uses have evicted them)
inline void prefetch_tensor(const at::Tensor& t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  for (int64_t line = 0; line < t.nbytes(); line += 64) __builtin_prefetch(p + line, 0, 3);
}

// A tensor over a step's buffer (not owning it: the step holds it for the whole call)
template <typename T>
Tensor rows_of(const Step<T>& step, T* data, int64_t width) {
  return at::from_blob(data, {step.tokens, width}, step.buffers.options());
}

// The experts' block on the normed rows `h`, as `SparseMoE.forward` computes it, through the same ops in the same
// order (so the same bits): the router's softmax in float32, the top k (renormalized where the family does), the
// (token, choice) pairs grouped by expert with one stable sort, each expert picked run once on its rows and its
// weighted output added into theirs in expert order, then the shared expert through its sigmoid gate.
template <typename T>
at::Tensor experts_block(const Experts& m, const at::Tensor& h, const Step<T>& step) {
  const at::Tensor probs = at::softmax(at::linear(h, m.router).to(at::kFloat), -1);
  auto [weights, chosen] = at::topk(probs, step.top_k, -1);
  if (step.normalize_top_k) weights = weights / weights.sum(-1, /*keepdim=*/true);
  weights = weights.to(h.scalar_type());
  const at::Tensor flat = chosen.flatten();
  const at::Tensor order = at::argsort(flat, /*stable=*/true, 0, /*descending=*/false);
  const at::Tensor counts = at::bincount(flat, {}, static_cast<int64_t>(m.experts.size()));
  const at::Tensor tokens = at::floor_divide(order, step.top_k);
  const at::Tensor picked = weights.flatten().index_select(0, order);
  at::Tensor out = at::zeros_like(h);
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (size_t e = 0; e < m.experts.size(); ++e) {
    const int64_t n = count[e];
    if (n == 0) continue;
    const at::Tensor rows = tokens.narrow(0, start, n);
    const at::Tensor y = m.experts[e].run<T>(h.index_select(0, rows), step.activation);
    out.index_add_(0, rows, y * picked.narrow(0, start, n).unsqueeze(1));
    start += n;
  }
  if (m.shared_gate.defined())
    out = out + at::sigmoid(at::linear(h, m.shared_gate)) * m.shared.run<T>(h, step.activation);
  return out;
}

// One layer. `x`: the residual stream so far (the step's `residual` buffer, or the embedded tokens for the first
// layer); `delta`: what the layer before adds to it (its down product), undefined for the first layer. Keeps the
// residual stream in `step.residual` and returns this layer's down product: the next layer adds it.
template <typename T, typename Timer>
Tensor decode_layer(const T* x, const Tensor& delta, LayerWeights& w, const LayerWeights* next, Step<T>& step,
                    Timer& timer) {
  const auto& ops = layer_ops();
  const int64_t tokens = step.tokens, hidden = step.hidden, head_dim = step.head_dim;
  const int64_t num_heads = step.num_heads, num_kv_heads = step.num_kv_heads, q_and_k = step.q_and_k();
  const double eps = step.eps;
  const bool offset = step.unit_offset;
  if (delta.defined()) {  // the layer before's residual add, and this layer's norm, in one pass
    norm_rows(x, static_cast<const T*>(delta.data_ptr()), w.input_norm, step.normed, step.residual, tokens, hidden,
              eps, offset);
    x = step.residual;
  } else {
    norm_rows<T>(x, nullptr, w.input_norm, step.normed, nullptr, tokens, hidden, eps, offset);
  }
  timer.mark(kInputNorm);
  const at::Tensor qkv = w.qkv(step.normed_rows, step.qkv);
  timer.mark(kQkv);
  const int64_t row = qkv.size(1);
  const T* qkv_data = qkv.data_ptr<T>();
  const T *cos = step.cos[w.rope], *sin = step.sin[w.rope];
  if (w.q_norm.defined()) {  // each head normed (as the eager layer's query and key norms), then rotary
    for (int64_t t = 0; t < tokens; ++t) {
      norm_rows<T>(qkv_data + t * row, nullptr, w.q_norm, step.qk_normed + t * q_and_k * head_dim, nullptr, num_heads,
                   head_dim, eps, offset, head_dim);
      norm_rows<T>(qkv_data + t * row + num_heads * head_dim, nullptr, w.k_norm,
                   step.qk_normed + (t * q_and_k + num_heads) * head_dim, nullptr, num_kv_heads, head_dim, eps, offset,
                   head_dim);
    }
    llmserve::elementwise::rotary_rows<T>(step.qk_normed, cos, sin, step.qk, tokens, q_and_k, head_dim,
                                          q_and_k * head_dim);
  } else {
    llmserve::elementwise::rotary_rows(qkv_data, cos, sin, step.qk, tokens, q_and_k, head_dim, row);
  }
  const T* v_data = qkv_data + q_and_k * head_dim;
  if (step.plain_slots) {  // k and v [token, kv head] rows to their slots
    auto* k_cache = w.k_cache.data_ptr<T>();
    auto* v_cache = w.v_cache.data_ptr<T>();
    const size_t bytes = head_dim * sizeof(T);
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t slot = step.slots[t * num_kv_heads + h];
        std::memcpy(k_cache + slot * head_dim, step.qk + (t * q_and_k + num_heads + h) * head_dim, bytes);
        std::memcpy(v_cache + slot * head_dim, v_data + t * row + h * head_dim, bytes);
      }
  } else {  // a 1-byte cache quantizes its rows: the op
    ops.write_kv.call(at::from_blob(step.qk + num_heads * head_dim, {tokens, num_kv_heads, head_dim},
                                    {q_and_k * head_dim, head_dim, 1}, qkv.options()),
                      view_of(qkv, q_and_k * head_dim, {tokens, num_kv_heads, head_dim}, {row, head_dim, 1}),
                      w.k_cache, w.v_cache, step.slots_tensor);
  }
  timer.mark(kRotary);
  llmserve::attention::decode_attention_out(step.queries, w.k_cache, w.v_cache, step.block_table, step.context_lens,
                                            step.scale, step.attended, w.window);
  timer.mark(kAttention);
  prefetch_tensor(w.post_norm);
  const at::Tensor o = w.o(step.attended_rows, step.o);
  timer.mark(kO);
  const T* o_data = static_cast<const T*>(o.data_ptr());
  if (w.pre_feedforward_norm.defined()) {  // sandwich: the output normed, added, and the sum normed for the MLP
    norm_rows<T>(o_data, nullptr, w.post_norm, step.block_out, nullptr, tokens, hidden, eps, offset);
    norm_rows<T>(x, step.block_out, w.pre_feedforward_norm, step.normed, step.residual, tokens, hidden, eps, offset);
  } else {
    norm_rows(x, o_data, w.post_norm, step.normed, step.residual, tokens, hidden, eps, offset);
  }
  timer.mark(kPostNorm);
  at::Tensor down;
  if (w.sparse()) {
    down = experts_block(w.moe, step.normed_rows, step);
    timer.mark(kDown);  // (the router, the experts' products and gates, and their sums, all timed as "down")
  } else {
    const at::Tensor gate_up = w.gate_up(step.normed_rows, step.gate_up);
    timer.mark(kGateUp);
    gate_rows<T>(step.activation, static_cast<const T*>(gate_up.data_ptr()), step.gated, tokens, step.intermediate,
                 2 * step.intermediate);
    timer.mark(kGate);
    if (next != nullptr) prefetch_tensor(next->input_norm);
    down = w.down(step.gated_rows, step.down);
    timer.mark(kDown);
  }
  if (w.post_feedforward_norm.defined()) {  // sandwich: the MLP's output normed before the next layer adds it
    norm_rows<T>(static_cast<const T*>(down.data_ptr()), nullptr, w.post_feedforward_norm, step.block_out, nullptr,
                 tokens, hidden, eps, offset);
    timer.mark(kPostNorm);
    return rows_of(step, step.block_out, hidden);
  }
  return down;
}

// Named fields, read once at construction (nothing here is looked up during a step): `field` and `optional_field`
// take one by name, `check_fields` refuses a name the stack does not read (a misspelt optional field would
// otherwise be dropped without a word).
template <typename V>
V field(const c10::Dict<std::string, V>& fields, const std::string& name, const char* where) {
  const auto found = fields.find(name);
  TORCH_CHECK(found != fields.end(), "DecodeStack.", where, ": no field '", name, "'");
  return found->value();
}

at::Tensor optional_field(const c10::Dict<std::string, at::Tensor>& fields, const std::string& name) {
  const auto found = fields.find(name);
  return found == fields.end() || !found->value().numel() ? at::Tensor() : found->value();
}

int64_t optional_size(const c10::Dict<std::string, int64_t>& sizes, const std::string& name, int64_t otherwise) {
  const auto found = sizes.find(name);
  return found == sizes.end() ? otherwise : found->value();
}

template <typename V>
void check_fields(const c10::Dict<std::string, V>& fields, std::initializer_list<const char*> known, const char* where) {
  for (const auto& entry : fields)
    TORCH_CHECK(std::any_of(known.begin(), known.end(), [&](const char* name) { return entry.key() == name; }),
                "DecodeStack.", where, ": unknown field '", entry.key(), "'");
}

// The decoder layers, built once from the model's tensors (shared, not copied) and its KV caches, so a step is one
// call with the step's own tensors only. Built by name, as the model describes itself (models/fused_stack.py): the
// model's own fields (its embedding, rotary tables and final norm; where it has them, `embedding_scale`, the windowed
// layers' `local_cos_table` and `local_sin_table`, `activation`, `norm_unit_offset`, and the experts' `top_k` and
// `normalize_top_k`), then each layer (`add_layer`: its norms, caches, and where it has them its q/k/v bias,
// query/key norms, sandwich norms, router, `window` and `rope` table) and its linears' parts (`add_part`, in row
// order: one, or a `StackedLinear`'s; an expert's after the one before it), then `finish`, which checks the last
// layer and the whole. A part names its small-step weight (`weight`, with `scales` for int8; int4 has none), its
// large-step product (`large_kind`, a `LargeStepKind`, reading `large_weight` and, where its kind does,
// `smooth_inv`, `large_scales` and `large_extra`), `rows`, `activation_parts` and `small_max_tokens`, the largest
// step its small-step kernel takes.
class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(c10::Dict<std::string, at::Tensor> model, c10::Dict<std::string, int64_t> sizes,
              c10::Dict<std::string, double> numbers)
      : embedding_(field(model, "embedding", "model")), cos_table_(field(model, "cos_table", "model")),
        sin_table_(field(model, "sin_table", "model")), final_norm_(field(model, "final_norm", "model")),
        local_cos_table_(optional_field(model, "local_cos_table")),
        local_sin_table_(optional_field(model, "local_sin_table")),
        num_heads_(field(sizes, "num_heads", "model")), intermediate_size_(field(sizes, "intermediate_size", "model")),
        activation_(optional_size(sizes, "activation", kSilu)),
        top_k_(optional_size(sizes, "top_k", 0)), normalize_top_k_(optional_size(sizes, "normalize_top_k", 0) != 0),
        unit_offset_(optional_size(sizes, "norm_unit_offset", 0) != 0),
        eps_(field(numbers, "eps", "model")), scale_(field(numbers, "scale", "model")) {
    check_fields(model, {"embedding", "cos_table", "sin_table", "final_norm", "embedding_scale", "local_cos_table",
                         "local_sin_table"}, "model");
    check_fields(sizes, {"num_heads", "intermediate_size", "activation", "norm_unit_offset", "top_k",
                         "normalize_top_k"}, "model");
    check_fields(numbers, {"eps", "scale"}, "model");
    TORCH_CHECK(activation_ == kSilu || activation_ == kGeluTanh, "DecodeStack: unknown activation ", activation_);
    const at::Tensor embedding_scale = optional_field(model, "embedding_scale");
    if (embedding_scale.defined()) {
      TORCH_CHECK(embedding_scale.numel() == 1 && embedding_scale.scalar_type() == embedding_.scalar_type(),
                  "DecodeStack: the embedding scale is one value in the embedding's dtype");
      embedding_scale_ = embedding_scale.item<float>();
    }
  }

  // A new layer (the one before it is checked): input_norm, post_norm, k_cache, v_cache; where the layer has them,
  // qkv_bias, q_norm and k_norm, pre_feedforward_norm and post_feedforward_norm, the experts' `router` and the
  // `shared_expert_gate`; sizes: `window` (0 or none: the whole context) and `rope` (1: the windowed layers' table)
  void add_layer(c10::Dict<std::string, at::Tensor> fields, c10::Dict<std::string, int64_t> sizes) {
    TORCH_CHECK(!finished_, "DecodeStack.add_layer: the stack is finished");
    if (!layers_.empty()) check_layer(layers_.back());
    check_fields(fields, {"input_norm", "post_norm", "k_cache", "v_cache", "qkv_bias", "q_norm", "k_norm",
                          "pre_feedforward_norm", "post_feedforward_norm", "router", "shared_expert_gate"},
                 "add_layer");
    check_fields(sizes, {"window", "rope"}, "add_layer");
    LayerWeights layer;
    layer.input_norm = field(fields, "input_norm", "add_layer");
    layer.post_norm = field(fields, "post_norm", "add_layer");
    layer.k_cache = field(fields, "k_cache", "add_layer");
    layer.v_cache = field(fields, "v_cache", "add_layer");
    layer.q_norm = optional_field(fields, "q_norm");
    layer.k_norm = optional_field(fields, "k_norm");
    layer.pre_feedforward_norm = optional_field(fields, "pre_feedforward_norm");
    layer.post_feedforward_norm = optional_field(fields, "post_feedforward_norm");
    layer.moe.router = optional_field(fields, "router");
    layer.moe.shared_gate = optional_field(fields, "shared_expert_gate");
    layer.window = optional_size(sizes, "window", 0);
    layer.rope = optional_size(sizes, "rope", 0);
    TORCH_CHECK(layer.window >= 0, "DecodeStack.add_layer: a window is 0 (none) or a number of tokens");
    TORCH_CHECK(layer.rope == 0 || layer.rope == 1, "DecodeStack.add_layer: rope is 0 (the model's table) or 1 "
                "(the windowed layers')");
    qkv_bias_ = optional_field(fields, "qkv_bias");
    layers_.push_back(std::move(layer));
  }

  // The next run of rows of the current layer's `linear`: qkv, o, and the dense MLP's gate_up and down, or an
  // expert's (expert_gate_up, expert_down, with the `expert`'s index in sizes: the next expert's or the last one's)
  // and the shared expert's (shared_gate_up, shared_down)
  void add_part(const std::string& linear, c10::Dict<std::string, at::Tensor> tensors,
                c10::Dict<std::string, int64_t> sizes) {
    TORCH_CHECK(!finished_ && !layers_.empty(), "DecodeStack.add_part: a part belongs to a layer (add_layer first)");
    check_fields(tensors, {"weight", "scales", "smooth_inv", "large_weight", "large_scales", "large_extra"},
                 "add_part");
    check_fields(sizes, {"rows", "activation_parts", "small_max_tokens", "large_kind", "expert"}, "add_part");
    LayerWeights& layer = layers_.back();
    Linear* target = linear == "qkv" ? &layer.qkv : linear == "o" ? &layer.o : linear == "gate_up" ? &layer.gate_up
                     : linear == "down" ? &layer.down : linear == "shared_gate_up" ? &layer.moe.shared.gate_up
                     : linear == "shared_down" ? &layer.moe.shared.down : nullptr;
    if (linear == "expert_gate_up" || linear == "expert_down") {
      auto& experts = layer.moe.experts;
      const int64_t expert = field(sizes, "expert", "add_part");
      TORCH_CHECK(expert == static_cast<int64_t>(experts.size()) - 1 ||
                      (expert == static_cast<int64_t>(experts.size()) && linear == "expert_gate_up"),
                  "DecodeStack.add_part: experts come in order, each its gate_up parts, then its down parts");
      if (expert == static_cast<int64_t>(experts.size())) experts.emplace_back();
      target = linear == "expert_gate_up" ? &experts.back().gate_up : &experts.back().down;
    }
    TORCH_CHECK(target != nullptr, "DecodeStack.add_part: unknown linear '", linear, "'");
    const int64_t kind = field(sizes, "large_kind", "add_part"), rows = field(sizes, "rows", "add_part");
    TORCH_CHECK(kind == kDense || kind == kOneDnn || kind == kAmx || kind == kNone,
                "DecodeStack: unknown large step ", kind);
    const int64_t small_max = field(sizes, "small_max_tokens", "add_part");
    const at::Tensor large_weight = optional_field(tensors, "large_weight");
    if (kind == kNone) {
      TORCH_CHECK(!large_weight.defined() && small_max == std::numeric_limits<int64_t>::max(),
                  "DecodeStack: a part without a large step takes every step on its own kernel (small_max_tokens "
                  "the largest int64) and has no large-step weight");
    } else {
      TORCH_CHECK(large_weight.defined() && (large_weight.is_mkldnn() || large_weight.numel()),
                  "DecodeStack: every part with a large step needs its large-step weight");
    }
    at::Tensor bias;
    if (linear == "qkv" && qkv_bias_.defined()) {  // each part adds its rows of the layer's bias
      const int64_t first_row = target->out_features();
      TORCH_CHECK(first_row + rows <= qkv_bias_.numel(), "DecodeStack: a q/k/v bias has one value per row");
      bias = qkv_bias_.narrow(0, first_row, rows);
    }
    target->parts.push_back({field(tensors, "weight", "add_part"), optional_field(tensors, "scales"), bias,
                             field(sizes, "activation_parts", "add_part"), rows, small_max,
                             LargeStep{kind, optional_field(tensors, "smooth_inv"), large_weight,
                                       optional_field(tensors, "large_scales"), optional_field(tensors, "large_extra")}});
    small_max_tokens_ = std::min(small_max_tokens_, small_max);
  }

  // Checks the last layer and what every layer shares with the model's own tensors; `run` needs it done
  void finish() {
    TORCH_CHECK(!layers_.empty(), "DecodeStack.finish: no layers");
    check_layer(layers_.back());
    const at::Tensor& input_norm = layers_[0].input_norm;
    const int64_t hidden = input_norm.numel(), head_dim = llmserve::attention::cache_head_dim(layers_[0].k_cache);
    TORCH_CHECK(embedding_.dim() == 2 && embedding_.size(1) == hidden && embedding_.is_contiguous() &&
                    (embedding_.scalar_type() == at::kFloat || embedding_.scalar_type() == at::kBFloat16),
                "DecodeStack: the embedding must be a contiguous float32 or bfloat16 [vocab, hidden]");
    TORCH_CHECK(embedding_.scalar_type() == at::kBFloat16 || input_norm.scalar_type() == at::kFloat,
                "DecodeStack: a float32 model needs float32 norm weights");
    TORCH_CHECK(cos_table_.dim() == 2 && cos_table_.size(1) == head_dim && cos_table_.is_contiguous() &&
                    (cos_table_.scalar_type() == at::kFloat || cos_table_.scalar_type() == embedding_.scalar_type()) &&
                    sin_table_.sizes() == cos_table_.sizes() && sin_table_.scalar_type() == cos_table_.scalar_type() &&
                    sin_table_.is_contiguous(),
                "DecodeStack: the rotary tables must be contiguous [positions, head_dim], float32 or the model's dtype");
    TORCH_CHECK(final_norm_.is_contiguous() && final_norm_.numel() == hidden &&
                    final_norm_.scalar_type() == input_norm.scalar_type(),
                "DecodeStack: the final norm's weights are like the layers' norms");
    const bool local = std::any_of(layers_.begin(), layers_.end(), [](const LayerWeights& l) { return l.rope == 1; });
    TORCH_CHECK(local == local_cos_table_.defined() && local == local_sin_table_.defined(),
                "DecodeStack: the windowed layers' rotary tables are given where a layer takes them (rope 1), only");
    TORCH_CHECK(!local || (local_cos_table_.sizes() == cos_table_.sizes() &&
                           local_cos_table_.scalar_type() == cos_table_.scalar_type() &&
                           local_cos_table_.is_contiguous() && local_sin_table_.sizes() == cos_table_.sizes() &&
                           local_sin_table_.scalar_type() == cos_table_.scalar_type() &&
                           local_sin_table_.is_contiguous()),
                "DecodeStack: the windowed layers' rotary tables are like the model's");
    const auto sparse = std::find_if(layers_.begin(), layers_.end(), [](const LayerWeights& l) { return l.sparse(); });
    sparse_ = sparse != layers_.end();
    TORCH_CHECK(!sparse_ || (top_k_ >= 1 && top_k_ <= sparse->moe.router.size(0)),
                "DecodeStack: a model with experts needs top_k, from 1 to its experts");
    finished_ = true;
  }

  // The tokens at their positions -> the hidden states after the final norm, [tokens, hidden]; writes each layer's
  // K/V. The embedding rows, the rotary tables' rows and the final norm are taken here too: in Python each is an
  // op or three run on cold caches after the step's weight stream.
  at::Tensor run(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slots,
                 const at::Tensor& block_table, const at::Tensor& context_lens) {
    NoTimer timer;
    return run_layers(input_ids, positions, slots, block_table, context_lens, timer);
  }

  // The same, adding each piece's wall time (summed over the layers) to `seconds` [pieces()], float64
  at::Tensor run_timed(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slots,
                       const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& seconds) {
    TORCH_CHECK(seconds.scalar_type() == at::kDouble && seconds.is_contiguous() && seconds.numel() == kPieces,
                "DecodeStack.run_timed: seconds must be a contiguous float64 tensor of ", kPieces, " elements");
    WallTimer timer{seconds.data_ptr<double>()};
    return run_layers(input_ids, positions, slots, block_table, context_lens, timer);
  }

  // The names of the pieces `run_timed` times, in its order
  static std::vector<std::string> pieces() { return {kPieceNames.begin(), kPieceNames.end()}; }

 private:
  // A layer's caches, norms and linears against the first layer's and the model's sizes
  void check_layer(const LayerWeights& layer) const {
    const LayerWeights& first = layers_[0];
    const bool sparse = layer.sparse();
    for (const Linear* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      TORCH_CHECK(!linear->parts.empty() || (sparse && (linear == &layer.gate_up || linear == &layer.down)),
                  "DecodeStack: each layer has four linears (qkv, o, gate_up, down) of one part or more, or experts "
                  "in place of gate_up and down");
    if (sparse) check_experts(layer);
    TORCH_CHECK(layer.k_cache.dim() == 4 && layer.k_cache.sizes() == layer.v_cache.sizes() &&
                    layer.k_cache.is_contiguous() && layer.v_cache.is_contiguous(),
                "DecodeStack: caches must be contiguous [blocks, kv_heads, block_size, head_dim]");
    // a step's shapes, dtypes and slots are read from the first layer's and hold for all
    TORCH_CHECK(layer.k_cache.sizes() == first.k_cache.sizes() &&
                    layer.k_cache.scalar_type() == first.k_cache.scalar_type() &&
                    layer.v_cache.scalar_type() == first.k_cache.scalar_type(),
                "DecodeStack: every layer's caches must have the first layer's shape and dtype");
    for (const at::Tensor* norm : {&layer.input_norm, &layer.post_norm})
      TORCH_CHECK(norm->is_contiguous() && norm->numel() == first.input_norm.numel() &&
                      norm->scalar_type() == first.input_norm.scalar_type() &&
                      (norm->scalar_type() == at::kFloat || norm->scalar_type() == at::kBFloat16),
                  "DecodeStack: norm weights must be contiguous float32 or bfloat16, one per feature, alike");
    const int64_t hidden = layer.input_norm.numel(), head_dim = llmserve::attention::cache_head_dim(layer.k_cache);
    TORCH_CHECK(layer.qkv.out_features() == (num_heads_ + 2 * layer.k_cache.size(1)) * head_dim &&
                    layer.o.out_features() == hidden &&
                    (sparse || (layer.gate_up.out_features() == 2 * intermediate_size_ &&
                                layer.down.out_features() == hidden)),
                "DecodeStack: a linear's parts must add up to its rows");
    TORCH_CHECK(!layer.qkv.parts[0].bias.defined() || layer.qkv.out_features() == qkv_bias_.numel(),
                "DecodeStack: a q/k/v bias has one value per row");
    // what a step's buffers are carved for is read from the first layer: every layer has the same norms
    TORCH_CHECK(layer.q_norm.defined() == first.q_norm.defined() && layer.k_norm.defined() == layer.q_norm.defined() &&
                    layer.pre_feedforward_norm.defined() == first.pre_feedforward_norm.defined() &&
                    layer.post_feedforward_norm.defined() == layer.pre_feedforward_norm.defined(),
                "DecodeStack: every layer has query and key norms or neither, and both sandwich norms or neither, "
                "as the first");
    for (const at::Tensor* norm : {&layer.pre_feedforward_norm, &layer.post_feedforward_norm})
      TORCH_CHECK(!norm->defined() || (norm->is_contiguous() && norm->numel() == hidden &&
                                       norm->scalar_type() == first.input_norm.scalar_type()),
                  "DecodeStack: norm weights must be contiguous float32 or bfloat16, one per feature, alike");
    for (const at::Tensor* norm : {&layer.q_norm, &layer.k_norm})
      TORCH_CHECK(!norm->defined() || (norm->is_contiguous() && norm->numel() == head_dim &&
                                       norm->scalar_type() == first.input_norm.scalar_type()),
                  "DecodeStack: a query or key norm has one contiguous weight per head feature, like the layer's "
                  "norms");
  }

  // A layer's experts: no dense MLP beside them, one expert a router row, each a gated MLP to the hidden size; a
  // shared expert with its gate or neither
  void check_experts(const LayerWeights& layer) const {
    const Experts& moe = layer.moe;
    const int64_t hidden = layer.input_norm.numel();
    TORCH_CHECK(layer.gate_up.parts.empty() && layer.down.parts.empty(),
                "DecodeStack: a layer has a dense MLP or experts, not both");
    TORCH_CHECK(moe.router.dim() == 2 && moe.router.size(1) == hidden && moe.router.is_contiguous() &&
                    moe.router.scalar_type() == embedding_.scalar_type() &&
                    moe.router.size(0) == static_cast<int64_t>(moe.experts.size()),
                "DecodeStack: the router is contiguous [experts, hidden] in the model's dtype, a row per expert given");
    auto check_mlp = [&](const ExpertMlp& mlp) {
      TORCH_CHECK(!mlp.gate_up.parts.empty() && !mlp.down.parts.empty() && mlp.gate_up.out_features() % 2 == 0 &&
                      mlp.down.out_features() == hidden,
                  "DecodeStack: an expert is a gate/up product of even rows and a down product to the hidden size");
    };
    for (const ExpertMlp& expert : moe.experts) check_mlp(expert);
    const bool shared = !moe.shared.gate_up.parts.empty() || !moe.shared.down.parts.empty();
    TORCH_CHECK(shared == moe.shared_gate.defined(), "DecodeStack: a shared expert comes with its gate, or neither");
    if (shared) {
      check_mlp(moe.shared);
      TORCH_CHECK(moe.shared_gate.dim() == 2 && moe.shared_gate.size(0) == 1 && moe.shared_gate.size(1) == hidden &&
                      moe.shared_gate.scalar_type() == embedding_.scalar_type(),
                  "DecodeStack: the shared expert's gate is [1, hidden] in the model's dtype");
    }
  }

  template <typename Timer>
  at::Tensor run_layers(const at::Tensor& input_ids_in, const at::Tensor& positions_in, const at::Tensor& slots,
                        const at::Tensor& block_table, const at::Tensor& context_lens, Timer& timer) {
    TORCH_CHECK(finished_, "DecodeStack.run: the stack is not finished (finish() after the last layer)");
    const at::Tensor input_ids = input_ids_in.contiguous(), positions = positions_in.contiguous();
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong && positions.sizes() == input_ids.sizes() &&
                    positions.scalar_type() == at::kLong,
                "DecodeStack.run: input_ids and positions: one int64 each per token");
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* where = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < input_ids.numel(); ++t) {  // (the local rotary table has the model's rows)
      TORCH_CHECK(ids[t] >= 0 && ids[t] < embedding_.size(0), "DecodeStack.run: token id out of range");
      TORCH_CHECK(where[t] >= 0 && where[t] < cos_table_.size(0), "DecodeStack.run: position out of range");
    }
    if (embedding_.scalar_type() == at::kFloat) return run_typed<float>(ids, where, input_ids.numel(), slots,
                                                                        block_table, context_lens, timer);
    return run_typed<at::BFloat16>(ids, where, input_ids.numel(), slots, block_table, context_lens, timer);
  }

  template <typename T, typename Timer>
  at::Tensor run_typed(const int64_t* ids, const int64_t* positions, int64_t tokens, const at::Tensor& slots_in,
                       const at::Tensor& block_table, const at::Tensor& context_lens, Timer& timer) {
    const at::TensorOptions options = embedding_.options();
    const LayerWeights& first = layers_[0];
    Step<T> step;
    step.tokens = tokens;
    step.hidden = embedding_.size(1);
    step.intermediate = intermediate_size_;
    step.num_heads = num_heads_;
    step.num_kv_heads = first.k_cache.size(1);
    step.head_dim = llmserve::attention::cache_head_dim(first.k_cache);
    step.eps = eps_;
    step.scale = scale_;
    step.unit_offset = unit_offset_;
    step.activation = activation_;
    step.top_k = top_k_;
    step.normalize_top_k = normalize_top_k_;
    // the slots, checked once for every layer's K/V write (as write_kv checks them)
    const at::Tensor slots = slots_in.contiguous();
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == step.tokens * step.num_kv_heads,
                "DecodeStack.run: slots: one int64 per (token, kv head)");
    step.slots_tensor = slots;
    step.slots = slots.data_ptr<int64_t>();
    const int64_t num_slots = first.k_cache.numel() / first.k_cache.size(3);
    for (int64_t r = 0; r < slots.numel(); ++r)
      TORCH_CHECK(step.slots[r] >= 0 && step.slots[r] < num_slots, "KV slot out of range");
    step.plain_slots = first.k_cache.scalar_type() == embedding_.scalar_type();
    TORCH_CHECK(step.plain_slots || llmserve::attention::is_quantized_cache(first.k_cache),
                "DecodeStack.run: the caches must hold the model's dtype or be quantized");
    step.block_table = block_table;
    step.context_lens = context_lens;
    const int64_t rows = step.tokens, head_dim = step.head_dim, hidden = step.hidden, inter = step.intermediate;
    const int64_t qk_width = step.q_and_k() * head_dim, attended_width = step.num_heads * head_dim;
    const int64_t qkv_width = qk_width + step.num_kv_heads * head_dim;
    // each buffer on a cache line of its own (64 bytes: 16 float32 or 32 bfloat16), in the order they are carved;
    // a buffer the model does not need is 0 wide
    const bool local = local_cos_table_.defined();
    const int64_t local_width = local ? head_dim : 0, qk_normed_width = first.q_norm.defined() ? qk_width : 0;
    const int64_t block_out_width = first.pre_feedforward_norm.defined() ? hidden : 0;
    const std::array<int64_t, 16> widths = {hidden, head_dim, head_dim, local_width, local_width, hidden, hidden,
                                            qk_width, inter, qk_normed_width, block_out_width, qkv_width,
                                            attended_width, hidden, 2 * inter, hidden};
    const int64_t line = 64 / static_cast<int64_t>(sizeof(T));
    int64_t total = 0;
    for (int64_t width : widths) total += (rows * width + line - 1) / line * line;
    step.buffers = at::empty({total}, options);
    T* const base = static_cast<T*>(step.buffers.data_ptr());
    T* next_free = base;
    auto carve = [&](int64_t width) {
      T* at = next_free;
      next_free += (rows * width + line - 1) / line * line;
      return at;
    };
    // the tokens' embedding rows, and their positions' rotary rows in the step's dtype (as `.to(dtype)` rounds)
    T* const embedded = carve(hidden);
    const T* const table = embedding_.data_ptr<T>();
    auto rotary_rows_of = [&](const at::Tensor& cos_table, const at::Tensor& sin_table, T* cos, T* sin) {
      auto copy = [&](const auto* cos_values, const auto* sin_values) {
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t i = 0; i < head_dim; ++i) {
            cos[t * head_dim + i] = static_cast<T>(cos_values[positions[t] * head_dim + i]);
            sin[t * head_dim + i] = static_cast<T>(sin_values[positions[t] * head_dim + i]);
          }
      };
      if (cos_table.scalar_type() == at::kFloat)
        copy(cos_table.data_ptr<float>(), sin_table.data_ptr<float>());
      else
        copy(cos_table.data_ptr<T>(), sin_table.data_ptr<T>());
    };
    T *const cos = carve(head_dim), *const sin = carve(head_dim);
    T *const local_cos = carve(local_width), *const local_sin = carve(local_width);
    rotary_rows_of(cos_table_, sin_table_, cos, sin);
    if (local) rotary_rows_of(local_cos_table_, local_sin_table_, local_cos, local_sin);
    step.cos = {cos, local_cos};
    step.sin = {sin, local_sin};
    for (int64_t t = 0; t < rows; ++t)
      std::memcpy(embedded + t * hidden, table + ids[t] * hidden, hidden * sizeof(T));
    if (embedding_scale_)  // as the eager `x * scale` in the model's dtype rounds
      for (int64_t i = 0; i < rows * hidden; ++i)
        embedded[i] = static_cast<T>(static_cast<float>(embedded[i]) * *embedding_scale_);
    step.residual = carve(hidden);
    step.normed = carve(hidden);
    step.qk = carve(qk_width);
    step.gated = carve(inter);
    step.qk_normed = carve(qk_normed_width);
    step.block_out = carve(block_out_width);
    step.normed_rows = rows_of(step, step.normed, hidden);
    step.gated_rows = rows_of(step, step.gated, inter);
    step.qkv = rows_of(step, carve(qkv_width), qkv_width);
    step.queries = at::from_blob(step.qk, {rows, step.num_heads, head_dim}, {qk_width, head_dim, 1}, options);
    T* attended = carve(attended_width);
    step.attended = at::from_blob(attended, {rows, step.num_heads, head_dim}, options);
    step.attended_rows = rows_of(step, attended, attended_width);
    step.o = rows_of(step, carve(hidden), hidden);
    step.gate_up = rows_of(step, carve(2 * inter), 2 * inter);
    step.down = rows_of(step, carve(hidden), hidden);
    TORCH_CHECK(next_free == base + total, "DecodeStack.run: the buffers carved are not the buffers sized");

    at::Tensor delta;
    auto layers = [&] {
      for (size_t i = 0; i < layers_.size(); ++i)
        delta = decode_layer(i == 0 ? embedded : step.residual, delta, layers_[i],
                             i + 1 < layers_.size() ? &layers_[i + 1] : nullptr, step, timer);
    };
    // A step every part's own kernel takes holds torch's threads as one team for all its layers (team.h); a larger
    // step's products are oneDNN's, and experts' routing ATen's, which fork their own
    if (tokens <= small_max_tokens_ && !sparse_)
      llmserve::team::with_team(layers);
    else
      layers();
    // the last layer's residual add and the final norm, in one pass (as `RMSNorm.add_forward`: the rounded sum
    // normalised)
    at::Tensor out = at::empty({rows, hidden}, options);
    norm_rows(step.residual, static_cast<const T*>(delta.data_ptr()), final_norm_, out.data_ptr<T>(), step.residual,
              rows, hidden, eps_, unit_offset_);
    timer.mark(kFinalNorm);
    return out;
  }

  std::vector<LayerWeights> layers_;
  at::Tensor qkv_bias_;  // the layer being added's (undefined: none)
  bool finished_ = false;
  at::Tensor embedding_, cos_table_, sin_table_, final_norm_, local_cos_table_, local_sin_table_;
  std::optional<float> embedding_scale_;  // the embedding's rows times this, rounded to its dtype (Gemma)
  int64_t num_heads_, intermediate_size_, activation_, top_k_;
  bool normalize_top_k_, unit_offset_;
  bool sparse_ = false;  // a layer has experts
  int64_t small_max_tokens_ = std::numeric_limits<int64_t>::max();  // the smallest of every part's small-step limit
  double eps_, scale_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<c10::Dict<std::string, at::Tensor>, c10::Dict<std::string, int64_t>,
                       c10::Dict<std::string, double>>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_part", &DecodeStack::add_part)
      .def("finish", &DecodeStack::finish)
      .def("run", &DecodeStack::run)
      .def("run_timed", &DecodeStack::run_timed)
      .def_static("pieces", &DecodeStack::pieces);
}
