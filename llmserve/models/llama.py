"""Llama-family decoder (Llama 2/3, SmolLM, Qwen2 through `attention_bias`).

The forward pass takes one flat batch of tokens from many requests — no padding, no batch axis —
with their positions; attention finds each request's past through the paged KV cache.
q/k/v and gate/up are fused into single matmuls at load time (fewer, larger GEMMs).
Linears and the embedding are created without drawing initial values (`_uninitialized_linear`, `from_pretrained`
of an empty matrix): a checkpoint fills every parameter (`load_weights` refuses one it lacks), and the draw costs
seconds of a start (docs/performance.md, "Start-up").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmserve.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from llmserve.quantization.weight_only import StackedLinear, WeightOnlyLinear


def _uninitialized_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """A linear whose parameters are empty CPU tensors: built on the meta device (no draw), then given storage.
    Not `torch.nn.utils.skip_init`: its `to_empty` goes through torch's reference ops, which import the symbolic
    shapes (and, for an embedding, torch._dynamo): a cost to a start that compiles nothing."""
    linear = nn.Linear(in_features, out_features, bias, device="meta")
    for name, param in list(linear.named_parameters(recurse=False)):
        setattr(linear, name, nn.Parameter(torch.empty(param.shape)))
    return linear


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    rope_scaling: dict | None = None
    architecture: str = "LlamaForCausalLM"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class LayerMethods:
    """How a decoder layer computes, chosen once by the build plan and held by every layer: the attention
    backend, and whether eager steps run the norms, rotary and SwiGLU gate on llmserve's fused CPU kernels
    (kernels/fused_elementwise.cpp: ~5 ops a layer instead of ~25). Compiled code keeps PyTorch's ops,
    which Inductor fuses itself."""

    attention: AttentionBackend = field(default_factory=TorchAttention)
    native_elementwise: bool = False


class LlamaAttention(nn.Module):
    """The attention block's weights and its projections; the decoder layer runs the attention itself."""

    def __init__(self, cfg: LlamaConfig, methods: LayerMethods) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = _uninitialized_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = _uninitialized_linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.backend = methods.attention
        self.native_rotary = methods.native_elementwise

    def source_rows(self, linear: str) -> list[int]:
        """The rows each checkpoint tensor gives one of these linears, in order (q, k, v: the fused q/k/v)."""
        return [self.q_size, self.kv_size, self.kv_size] if linear == "qkv_proj" else [self.o_proj.out_features]

    def project(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]  # x: [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k, v [T, kv_heads, head_dim], rotary applied to q and k."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent columns of the fused projection: one rotary pass covers both
        native = self.native_rotary and not torch.compiler.is_compiling()
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), *cos_sin, native)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, methods: LayerMethods) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.tp = None  # tensor parallel (distributed/tensor_parallel.py): down_proj's partial sums are all-reduced
        self.gate_up_proj = _uninitialized_linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = _uninitialized_linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.native = methods.native_elementwise

    def source_rows(self, linear: str) -> list[int]:
        """The rows each checkpoint tensor gives one of these linears, in order (gate, up: the fused gate/up)."""
        return [self.intermediate_size] * 2 if linear == "gate_up_proj" else [self.down_proj.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native and not torch.compiler.is_compiling():
            out = self.down_proj(torch.ops.llmserve.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            out = self.down_proj(nn.functional.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, methods: LayerMethods) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, methods.native_elementwise)
        self.self_attn = LlamaAttention(cfg, methods)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, methods.native_elementwise)
        self.mlp = LlamaMLP(cfg, methods)
        self.tp = None  # tensor parallel: o_proj's partial sums are all-reduced

    def forward(self, x, cos_sin, kv_cache, meta) -> torch.Tensor:
        # self_attn's steps, spelled out here: eager attention is a compiled layer's one graph break,
        # and a break inside a nested call would split the layer into four compiled regions, not two.
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x), cos_sin)
        o = attn.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale)
        o = attn.o_proj(o.flatten(1))
        if self.tp is not None:
            o = self.tp.all_reduce(o)
        x, h = self.post_attention_layernorm.add_forward(x, o)
        return x + self.mlp(h)


def use_native_elementwise(model: nn.Module, native: bool = True) -> None:
    """Switch the layers' norms, rotary and gate (and the final norm) between the native kernels (the
    caller has loaded them) and PyTorch's ops. The build plan decides; benchmarks and tests switch."""
    for module in model.modules():
        if isinstance(module, RMSNorm | LlamaMLP):
            module.native = native
        elif isinstance(module, LlamaAttention):
            module.native_rotary = native


def fused_decode_stack(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """The model's body (embedding, decoder layers, final norm) as one native call for decode-only steps
    (kernels/decode_layer.cpp): at batch 1 the Python between a layer's ~11 kernels costs a good share of a step
    (docs/performance.md, "The one-call decode step"). Built from the embedding, the rotary tables, the layers' native
    int4 or int8 weights (a `StackedLinear`'s parts each), their large-step products for steps past the small-step
    kernels (int8 x int8, or dense on the quantized values: build it after `prepack_linears`, and again once
    calibration gives the layers int8 weights), q/k/v biases, norms and KV caches (shared, not copied); it
    computes as the layers do, bit for bit, at any decode step's size. Raises ValueError where a layer's weights
    are not on the native kernels."""
    layers = list(model.layers)
    linears = [lin for layer in layers for lin in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if not all(isinstance(lin, WeightOnlyLinear | StackedLinear) and lin.native for lin in linears):
        raise ValueError("the fused decode stack needs every decoder linear on the native int4 or int8 kernels")
    if any(lin.bias is not None for layer in layers for lin in (layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                                                 layer.mlp.down_proj)):
        raise ValueError("the fused decode stack takes a bias on q/k/v only")
    parts = [list(lin.parts) if isinstance(lin, StackedLinear) else [lin] for lin in linears]
    flat = [part for each in parts for part in each]
    none = torch.empty(0)
    cfg = model.config
    return torch.classes.llmserve.DecodeStack(
        [layer.input_layernorm.weight for layer in layers],
        [layer.post_attention_layernorm.weight for layer in layers],
        [part.qweight for part in flat],
        [part.scales if part.method == "int8" else none for part in flat],
        [none if layer.self_attn.qkv_proj.bias is None else layer.self_attn.qkv_proj.bias for layer in layers],
        [k for k, _ in kv_caches], [v for _, v in kv_caches],
        cfg.num_heads, cfg.intermediate_size, cfg.rms_norm_eps, layers[0].self_attn.scale,
        [part.activation_parts for part in flat], [len(each) for each in parts], [part.out_features for part in flat],
        [part.max_quantized_tokens for part in flat],
        [_LARGE_STEP_KINDS[part.large_step_kernel] for part in flat],
        [t if t is not None else none for part in flat for t in _large_step_tensors(part)],
        model.embed_tokens.weight, model.rotary.cos_cache, model.rotary.signed_sin_cache, model.norm.weight,
    )


# a part's large-step product, as the stack names it (decode_layer.cpp, `LargeStepKind`)
_LARGE_STEP_KINDS = {"dense": 0, "onednn": 1, "amx": 2}


def _large_step_tensors(part: WeightOnlyLinear) -> tuple[torch.Tensor | None, ...]:
    """What the stack's large-step product reads: smooth_inv, the weight, its scales, and zero points (oneDNN's)
    or compensation (the AMX kernel's); for the dense product only the weight, oneDNN's packed copy where it has one
    (the plain one may be released)."""
    if part.large_step_kernel == "amx":
        return part.smooth_inv, part.int8_amx_packed, part.int8_scales, part.int8_compensation
    if part.large_step_kernel == "onednn":
        return part.smooth_inv, part.int8_packed, part.int8_scales, part.int8_zeros
    return None, part.packed if part.packed is not None else part.weight, None, None


def compile_layers(model: nn.Module) -> None:
    """torch.compile every decoder layer's forward, shapes dynamic in the token count.

    Layers share their compiled graphs (parameters are graph inputs; two per layer, split by the eager
    attention), so compiling costs one layer's worth.
    What it buys on CPU: the norms, rotary, SiLU-gating and residual adds become a few fused loops
    instead of ~30 small kernels per layer, each with its own dispatch overhead."""
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


# our fused linears and the checkpoint tensors they are made of, stacked by rows
_FUSED_LINEARS = {
    ".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
    ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj."),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, methods: LayerMethods | None = None) -> None:
        super().__init__()
        methods = methods or LayerMethods()
        self.config = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, methods) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, methods.native_elementwise)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.lm_head = _uninitialized_linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # the embedding matrix is the output head: one shared parameter
            self.lm_head.weight = self.embed_tokens.weight
        self.tp = None  # tensor parallel: each rank's head holds some vocabulary rows

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], layer by layer."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def forward_fused(self, stack, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """The same, for a decode-only step, as one call of `fused_decode_stack` (the embedding, the rotary rows and
        the final norm inside it)."""
        decodes = meta.decodes
        return stack.run(input_ids, positions, meta.write_slots, decodes.block_table, decodes.context_lens)

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        """Logits [N, vocab] for the rows that will be sampled: float32, or (`as_float` False, one rank) the head's
        own dtype, for a caller that only takes each row's maximum."""
        logits = self.lm_head(hidden)
        if self.tp is None:
            return logits.float() if as_float else logits
        return self.tp.gather_vocab(logits.float(), self.config.vocab_size)

    @staticmethod
    def checkpoint_sources(name: str) -> list[str]:
        """The Hugging Face tensors (without "model.") that make up this parameter, in row order."""
        for fused_part, parts in _FUSED_LINEARS.items():
            if fused_part in name:
                return [name.replace(fused_part, p) for p in parts]
        return [name]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Raises on missing or extra.
        Consumes `weights`: each tensor is released once copied, so the checkpoint and the model never
        both exist whole (see `build_model`)."""
        own = dict(self.named_parameters())
        remaining = {k.removeprefix("model."): v for k, v in weights.items()}
        weights.clear()
        if self.config.tie_word_embeddings:
            remaining.pop("lm_head.weight", None)
        loaded = set()
        for name, param in own.items():
            sources = self.checkpoint_sources(name)
            missing = [s for s in sources if s not in remaining]
            if missing:
                raise ValueError(f"checkpoint lacks {missing[0]!r}")
            parts = [remaining.pop(s) for s in sources]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            if shape != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {shape} != {tuple(param.shape)}")
            with torch.no_grad():  # each part straight into its rows, cast on the way: no concatenation, no cast copy
                row = 0
                for part in parts:
                    param[row:row + part.shape[0]].copy_(part)
                    row += part.shape[0]
            del parts
            loaded.add(name)
        extra = [k for k in remaining if "rotary_emb" not in k]
        if extra:
            raise ValueError(f"checkpoint has tensors the model does not use: {extra[:5]}")
