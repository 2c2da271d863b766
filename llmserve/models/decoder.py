"""The decoder every family runs: Llama's, with each family's differences read from its description
(`ModelConfig`: norms, query/key norms, activation, sliding windows, a local rotary base, experts).

The forward pass takes one flat batch of tokens from many requests — no padding, no batch axis —
with their positions; attention finds each request's past through the paged KV cache.
q/k/v and gate/up are fused into single matmuls at load time (fewer, larger GEMMs). Parameters are
created without drawing initial values (`uninitialized_linear`, `from_pretrained` of an empty matrix): a
checkpoint fills every one (`load_weights` refuses one it lacks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from llmserve.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from llmserve.layers.attention.whole_sequence import WholeSequenceAttention
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.mlp import GatedMLP, uninitialized_linear
from llmserve.layers.moe import SparseMoE
from llmserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from llmserve.models.config import ModelConfig


@dataclass(frozen=True)
class LayerMethods:
    """How a decoder layer computes, chosen once by the build plan and held by every layer: the attention
    backend, and whether eager steps run the norms, rotary and gate on llmserve's fused CPU kernels
    (kernels/fused_elementwise.cpp: ~5 ops a layer instead of ~25). Compiled code keeps PyTorch's ops,
    which Inductor fuses itself."""

    attention: AttentionBackend = field(default_factory=TorchAttention)
    native_elementwise: bool = False


class Attention(nn.Module):
    """The attention block's weights and its projections; the decoder layer runs the attention itself."""

    def __init__(self, cfg: ModelConfig, layer: int, methods: LayerMethods) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = uninitialized_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = uninitialized_linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            native, offset = methods.native_elementwise, cfg.norm_unit_offset
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, native, offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, native, offset)
        self.scale = cfg.attention_scale
        self.window = cfg.window(layer)
        self.rope = int(cfg.local_rope(layer))  # which of the model's rotary tables: 1 the local one
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
        native = self.native_rotary and not torch.compiler.is_compiling()
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head normed on its own, before rotary
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            return apply_rotary(q, *cos_sin, native), apply_rotary(k, *cos_sin, native), v
        # q and k heads are adjacent columns of the fused projection: one rotary pass covers both
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), *cos_sin, native)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, methods: LayerMethods) -> None:
        super().__init__()
        native, offset = methods.native_elementwise, cfg.norm_unit_offset

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, native, offset)

        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer, methods)
        # the norm after attention: of the MLP's input (Llama), or of the attention's output (sandwich norms)
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = (SparseMoE(cfg.hidden_size, cfg.moe, cfg.activation, native) if cfg.sparse(layer)
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation, native))
        self.tp = None  # tensor parallel: o_proj's partial sums are all-reduced

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        # self_attn's steps, spelled out here: eager attention is a compiled layer's one graph break,
        # and a break inside a nested call would split the layer into four compiled regions, not two.
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x), rope[attn.rope])
        o = attn.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale, attn.window)
        o = attn.o_proj(o.flatten(1))
        if self.tp is not None:
            o = self.tp.all_reduce(o)
        if self.sandwich:
            x, h = self.pre_feedforward_layernorm.add_forward(x, self.post_attention_layernorm(o))
            return x + self.post_feedforward_layernorm(self.mlp(h))
        x, h = self.post_attention_layernorm.add_forward(x, o)
        return x + self.mlp(h)

    def attend(self, normed: torch.Tensor, rope, kv_cache, meta) -> torch.Tensor:
        """The attention block from its normed input to o_proj's output (one rank): what a calibration varies
        q/k/v against. The same steps as `forward`'s, which spells them out for its compiled graph."""
        attn = self.self_attn
        q, k, v = attn.project(normed, rope[attn.rope])
        return attn.o_proj(attn.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale,
                                                attn.window).flatten(1))

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """The norm that makes the MLP's input (a calibration folds scales into it)."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm


def use_native_elementwise(model: nn.Module, native: bool = True) -> None:
    """Switch the layers' norms (query/key norms too), rotary and gate (and the final norm) between the native
    kernels (the caller has loaded them) and PyTorch's ops. The build plan decides; benchmarks and tests switch."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.native = native
        elif isinstance(module, GatedMLP):
            module.native = native
        elif isinstance(module, Attention):
            module.native_rotary = native


def compile_layers(model: nn.Module) -> None:
    """torch.compile every decoder layer's forward, shapes dynamic in the token count.

    Layers share their compiled graphs (parameters are graph inputs; two per layer, split by the eager
    attention), so compiling costs one layer's worth.
    What it buys on CPU: the norms, rotary, SiLU-gating and residual adds become a few fused loops
    instead of ~30 small kernels per layer, each with its own dispatch overhead."""
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


# our fused linears and the checkpoint tensors they are made of, stacked by rows (the dense MLP's, each expert's
# and a shared expert's gate/up alike)
_FUSED_LINEARS = {
    ".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, methods: LayerMethods | None = None) -> None:
        super().__init__()
        methods = methods or LayerMethods()
        self.config = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=False)
        # Gemma: embeddings times sqrt(hidden), the factor rounded to the model dtype first (model.to casts it)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5) if cfg.embedding_scale else None,
                             persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, methods) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, methods.native_elementwise, cfg.norm_unit_offset)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        # windowed layers' own table (Gemma 3's local layers): another base, no scaling
        self.local_rotary = None
        if cfg.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta)
        self.lm_head = uninitialized_linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # the embedding matrix is the output head: one shared parameter
            self.lm_head.weight = self.embed_tokens.weight
        self.tp = None  # tensor parallel: each rank's head holds some vocabulary rows
        self.pp = None  # pipeline parallel: this stage's layers, between the previous stage and the next

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], layer by layer. A pipeline stage (`pp`) past the first
        takes its input from the stage before; one before the last sends its output on (and returns it unnormed)."""
        pp = self.pp
        if pp is None or pp.first:
            x = self.embed(input_ids)
        else:
            x = pp.receive(len(input_ids), self.config.hidden_size, input_ids.device)
        rope = self.rope_tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta)
        if pp is not None and not pp.last:
            pp.send(x)
            return x
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """The rotary (cos, sin) rows of `positions` for each of the model's tables (a layer picks by `.rope`)."""
        rope = (self.rotary.lookup(positions, dtype),)
        if self.local_rotary is not None:
            rope += (self.local_rotary.lookup(positions, dtype),)
        return rope

    @contextmanager
    def whole_sequence(self) -> Iterator[list[tuple[None, None]]]:
        """Within: the layers attend over one whole sequence without a KV cache (`WholeSequenceAttention`); yields
        the per-layer caches (None) a forward takes. How calibrations run the serving forward."""
        attns = [layer.self_attn for layer in self.layers]
        serving = [attn.backend for attn in attns]
        for attn in attns:
            attn.backend = WholeSequenceAttention()
        try:
            yield [(None, None)] * len(attns)
        finally:
            for attn, backend in zip(attns, serving, strict=True):
                attn.backend = backend

    def forward_sequence(self, ids: torch.Tensor) -> torch.Tensor:
        """One sequence's hidden states after the final norm, [T, hidden], run as one causal sequence without a
        KV cache (one rank): how calibrations see the model."""
        with self.whole_sequence() as caches:
            return self.forward(ids, torch.arange(len(ids), device=ids.device), caches, None)

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
        """The Hugging Face tensors (Llama's names, without "model.") that make up this parameter, in row order."""
        for fused_part, parts in _FUSED_LINEARS.items():
            if fused_part in name:
                return [name.replace(fused_part, p) for p in parts]
        return [name]

    def load_weights(self, weights: MutableMapping[str, torch.Tensor],
                     on_layer_loaded: Callable[[int], None] | None = None) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Raises on missing or extra.
        Consumes `weights`: each tensor is taken out (a lazy checkpoint's decoded then) and released once copied, so
        the checkpoint and the model never both exist whole (see `build_model`). `on_layer_loaded(i)`: called once
        decoder layer i holds all its weights (before the next layer's are read), so that a caller can turn it into
        what it serves (quantized) while the rest still waits in the file."""
        names = {k.removeprefix("model."): k for k in weights}
        if self.config.tie_word_embeddings and "lm_head.weight" in names:
            del weights[names.pop("lm_head.weight")]
        # by name, not holding the parameters: a layer replaced by `on_layer_loaded` must free its own
        order = [name for name, _ in self.named_parameters()]
        loading = None  # the decoder layer being loaded
        for name in tqdm(order, desc="Loading weights", unit="tensor", leave=False):
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            if on_layer_loaded is not None and loading is not None and layer != loading:
                on_layer_loaded(loading)
            loading = layer
            param = self.get_parameter(name)
            sources = self.checkpoint_sources(name)
            missing = [s for s in sources if s not in names]
            if missing:
                raise ValueError(f"checkpoint lacks {missing[0]!r}")
            parts = [weights.pop(names.pop(s)) for s in sources]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            if shape != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {shape} != {tuple(param.shape)}")
            with torch.no_grad():  # each part straight into its rows, cast on the way: no concatenation, no cast copy
                row = 0
                for part in parts:
                    param[row:row + part.shape[0]].copy_(part)
                    row += part.shape[0]
            del parts, param
        if on_layer_loaded is not None and loading is not None:
            on_layer_loaded(loading)
        extra = [k for k in names if "rotary_emb" not in k]
        weights.clear()
        if extra:
            raise ValueError(f"checkpoint has tensors the model does not use: {extra[:5]}")
