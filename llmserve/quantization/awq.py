"""Activation-aware weight quantization (AWQ, Lin et al. 2023): per-input-channel scales searched on
calibration text, folded into the op before, then int4 groups.

Why: round to nearest spends int4's 16 levels alike on every input channel, but a few channels carry
much larger activations, and their weights' rounding errors weigh most in the output. Scaling such a
channel's weights up by s (and its activations down by 1/s) gives them finer levels relative to their
size. Per group of linears that read the same input, s = mean|x|^alpha (x: their calibration inputs,
normalized so max(s) * min(s) = 1), and alpha in [0, 1) is picked by a grid search on the block's output
error against the full-precision output; alpha = 0 is s = 1, round to nearest, so the search never does
worse than it on the data it measures. 1/s is folded into the op that makes the input (the RMSNorm's
weight, v_proj's rows, up_proj's rows), so the model computes the same function with the same graph
and our int4 kernels run it. Then AutoAWQ's clipping search: per group of weights, the clamp range
[-m, m], m in (0.5, 1] x max|w|, with the least output error of that linear.

The groups of AutoAWQ's Llama/Qwen2 recipe (awq/models/llama.py): q/k/v after input_layernorm (error
measured on the attention block's output), gate/up after post_attention_layernorm (on the MLP's output),
o after v (only where there is one v head per query head: with grouped heads one v channel feeds several
o channels), down after up. Searches run on the full-precision layer, then all scales are applied;
each layer's calibration inputs are the full-precision model's (the previous layer before quantization).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from llmserve.quantization.int4_groups import Int4Groups, check_group_size, fake_quantize, fit_groups
from llmserve.quantization.int8_activations import calibration_prompts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AWQConfig:
    group_size: int = 128  # inputs per scale and zero point (a multiple of 32: our kernels' group)
    grid: int = 20  # alpha in {0, 1/grid, ..., (grid-1)/grid}
    duo_scaling: bool = False  # AutoAWQ's later s = mean|x|^a / mean|w|^(1-a) instead of the paper's mean|x|^a
    clip: bool = True  # the clipping search after the scales
    max_shrink: float = 0.5  # clip ranges down to (1 - max_shrink) x max|w|, in steps of 1/grid
    max_seq_len: int = 512  # calibration sequence length in tokens

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        if self.grid < 1:
            raise ValueError(f"AWQ grid must be >= 1, got {self.grid}")
        if not 0 <= self.max_shrink < 1:
            raise ValueError(f"AWQ max_shrink must be in [0, 1), got {self.max_shrink}")
        if self.max_seq_len < 2:
            raise ValueError(f"AWQ max_seq_len must be >= 2, got {self.max_seq_len}")


@dataclass(frozen=True)
class BlockSearch:
    """One scale search: which alpha won and the block's output error (mean squared) with it and with
    alpha = 0 (round to nearest)."""

    layer: int
    block: str  # "qkv", "o", "gate_up" or "down"
    alpha: float
    error: float
    rtn_error: float
    scales: torch.Tensor = field(repr=False)  # s per input channel: the linear's columns were multiplied by it


@dataclass
class AWQResult:
    groups: dict[str, Int4Groups]  # the model's parameter name ("layers.0.mlp.down_proj.weight") -> its groups
    searches: list[BlockSearch] = field(default_factory=list)


def calibration_samples(tokenizer, max_seq_len: int) -> list[torch.Tensor]:
    """The calibration text (quantization/calibration.txt: questions, code, arithmetic, prose) as token
    sequences of at most `max_seq_len` tokens (the whole text, cut in order)."""
    ids = tokenizer.encode("\n\n".join(calibration_prompts()), add_special_tokens=False)
    return [torch.tensor(ids[i : i + max_seq_len]) for i in range(0, len(ids), max_seq_len) if len(ids) - i >= 2]


@torch.no_grad()
def awq_quantize(model: nn.Module, samples: list[torch.Tensor], config: AWQConfig,
                 quantize: bool = True) -> AWQResult:
    """Search and fold the scales, clip, and fit the int4 groups of every decoder linear of `model` (our
    dense `LlamaForCausalLM` on PyTorch ops, float32 for a precise search), in place. `quantize`: the
    linears then hold their dequantized int4 values; False leaves them at full precision (scaled and
    clipped), for checking that the folding keeps the model's function."""
    start = time.perf_counter()
    result = AWQResult({})
    xs = [model.embed_tokens(ids) for ids in samples]
    cos_sins = [model.rotary.lookup(torch.arange(len(ids)), xs[0].dtype) for ids in samples]
    for index, layer in enumerate(model.layers):
        xs = _quantize_layer(index, layer, xs, cos_sins, config, quantize, result)
        logger.info("AWQ: layer %d/%d searched (%.0fs)", index + 1, len(model.layers), time.perf_counter() - start)
    logger.info("AWQ: %d layers searched on %d calibration tokens in %.1fs", len(model.layers),
                sum(len(s) for s in samples), time.perf_counter() - start)
    return result


def attention_output(layer: nn.Module, normed: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                     ) -> torch.Tensor:
    """One sequence's causal attention before o_proj, [T, heads * head_dim], from the normed input [T, hidden]."""
    attn = layer.self_attn
    q, k, v = attn.project(normed, cos_sin)
    repeat = attn.num_heads // attn.num_kv_heads
    # [1, heads, T, head_dim]: with a batch dimension PyTorch's CPU flash kernel takes it (without, its
    # math fallback: ~5x slower at 1,024 tokens)
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)))
    o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return o[0].transpose(0, 1).flatten(1)


def causal_forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One sequence's hidden states after the final norm, [T, hidden], run as one causal sequence on PyTorch
    ops without a KV cache: how calibrations see the model."""
    x = model.embed_tokens(ids)
    cos_sin = model.rotary.lookup(torch.arange(len(ids), device=ids.device), x.dtype)
    for layer in model.layers:
        x = x + layer.self_attn.o_proj(attention_output(layer, layer.input_layernorm(x), cos_sin))
        x = x + layer.mlp.down_proj(gated_activation(layer, layer.post_attention_layernorm(x)))
    return model.norm(x)


def gated_activation(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The MLP's input to down_proj: silu(gate) * up, [T, intermediate]."""
    gate, up = layer.mlp.gate_up_proj(h).split(layer.mlp.intermediate_size, dim=-1)
    return nn.functional.silu(gate) * up


def _quantize_layer(index: int, layer: nn.Module, xs: list[torch.Tensor], cos_sins: list, config: AWQConfig,
                    quantize: bool, result: AWQResult) -> list[torch.Tensor]:
    """One decoder layer; returns its full-precision outputs (the next layer's calibration inputs)."""
    attn, mlp = layer.self_attn, layer.mlp
    # the full-precision layer's inputs to each linear, per sequence
    normed = [layer.input_layernorm(x) for x in xs]
    attended = [attention_output(layer, a, cs) for a, cs in zip(normed, cos_sins, strict=True)]
    mids = [x + attn.o_proj(o) for x, o in zip(xs, attended, strict=True)]
    hs = [layer.post_attention_layernorm(m) for m in mids]
    gated = [gated_activation(layer, h) for h in hs]
    outputs = [m + mlp.down_proj(g) for m, g in zip(mids, gated, strict=True)]
    a, o, h, g = (torch.cat(t) for t in (normed, attended, hs, gated))

    def attention_block() -> torch.Tensor:
        return torch.cat([attn.o_proj(attention_output(layer, n, cs)) for n, cs in zip(normed, cos_sins, strict=True)])

    searches = {  # block -> (its linear, its input, the block's output as a function of the linear's weight)
        "qkv": (attn.qkv_proj, a, attention_block),
        "gate_up": (mlp.gate_up_proj, h, lambda: mlp.down_proj(gated_activation(layer, h))),
        "down": (mlp.down_proj, g, lambda: mlp.down_proj(g)),
    }
    if attn.num_heads == attn.num_kv_heads:
        searches["o"] = (attn.o_proj, o, lambda: attn.o_proj(o))
    scales = {}
    for block, (linear, x, inspect) in searches.items():
        scales[block], search = _search_scales(linear, x, inspect, config)
        result.searches.append(BlockSearch(index, block, *search, scales=scales[block]))
    # fold: the op before divides by s, the linear's input columns multiply by it (and so do its inputs,
    # for the clipping search below)
    v_rows = slice(attn.q_size + attn.kv_size, None)
    up_rows = slice(mlp.intermediate_size, None)
    _fold(scales["qkv"], layer.input_layernorm.weight, None, attn.qkv_proj)
    if "o" in scales:
        _fold(scales["o"], attn.qkv_proj.weight[v_rows], attn.qkv_proj.bias, attn.o_proj, v_rows)
        o = o / scales["o"]
    _fold(scales["gate_up"], layer.post_attention_layernorm.weight, None, mlp.gate_up_proj)
    _fold(scales["down"], mlp.gate_up_proj.weight[up_rows], None, mlp.down_proj)
    a, h, g = a / scales["qkv"], h / scales["gate_up"], g / scales["down"]

    gs = config.group_size
    linears = (("self_attn.qkv_proj", attn.qkv_proj, a, v_rows), ("self_attn.o_proj", attn.o_proj, o, None),
               ("mlp.gate_up_proj", mlp.gate_up_proj, h, None), ("mlp.down_proj", mlp.down_proj, g, None))
    for name, linear, x, rows in linears:
        if config.clip:  # q and k are not clipped (AutoAWQ: their errors go through the softmax)
            w = linear.weight
            target = w[rows] if rows is not None else w
            target.copy_(clip_weight(target, x, gs, config))
        groups = fit_groups(linear.weight, gs)
        result.groups[f"layers.{index}.{name}.weight"] = groups
        if quantize:
            linear.weight.copy_(groups.dequantize())
    return outputs


def _search_scales(linear: nn.Linear, x: torch.Tensor, inspect: Callable[[], torch.Tensor], config: AWQConfig
                   ) -> tuple[torch.Tensor, tuple[float, float, float]]:
    """The best s over the alpha grid for `linear` (its input `x` [N, in]) by the error of `inspect()`."""
    weight = linear.weight.detach().clone()
    reference = inspect()
    x_mean = x.abs().mean(dim=0)
    if config.duo_scaling:  # each weight relative to its group's largest, averaged over the output rows
        groups = weight.abs().view(weight.shape[0], -1, config.group_size)
        w_mean = (groups / (groups.amax(dim=-1, keepdim=True) + 1e-6)).view_as(weight).mean(dim=0)
    best: tuple[float, torch.Tensor, float] | None = None
    rtn_error = float("nan")
    for step in range(config.grid):
        alpha = step / config.grid
        if config.duo_scaling:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        linear.weight.copy_(fake_quantize(weight * s, config.group_size) / s)
        error = (inspect() - reference).float().pow(2).mean().item()
        if step == 0:
            rtn_error = error
        if best is None or error < best[0]:
            best = (error, s, alpha)
    linear.weight.copy_(weight)
    error, s, alpha = best
    return s, (alpha, error, rtn_error)


def _fold(s: torch.Tensor, before: torch.Tensor, before_bias: torch.Tensor | None, linear: nn.Linear,
          bias_rows: slice | None = None) -> None:
    """Divide what makes the input by s (a norm's weight or a linear's rows, in place) and multiply the
    linear's input columns by it: the product is unchanged."""
    before.div_(s.view(-1, 1) if before.dim() == 2 else s)
    if before_bias is not None and bias_rows is not None:
        before_bias[bias_rows].div_(s)
    linear.weight.mul_(s)


def clip_weight(w: torch.Tensor, x: torch.Tensor, group_size: int, config: AWQConfig) -> torch.Tensor:
    """w [out, in] clamped per group of `group_size` to the [-m, m] whose int4 rounding gives the least
    mean squared output error on the inputs x [N, in]. A group's error is d^T G d, d its rounding error
    and G = x^T x / N over that group's inputs: AutoAWQ's error (sum over the group's products, squared,
    averaged over tokens), on every calibration token, computed as a product per group."""
    out_features, in_features = w.shape
    n_groups = in_features // group_size
    xg = x.float().view(-1, n_groups, group_size).transpose(0, 1)  # [groups, N, gs]
    gram = xg.transpose(1, 2) @ xg / x.shape[0]  # [groups, gs, gs]
    clipped = torch.empty_like(w)
    for start in range(0, out_features, 2048):  # bounded memory: a chunk of rows at a time
        rows = w[start : start + 2048].float().view(-1, n_groups, group_size)
        largest = rows.abs().amax(dim=-1, keepdim=True)
        best_max, best_error = largest.clone(), torch.full_like(largest, float("inf"))
        for step in range(int(config.max_shrink * config.grid)):
            limit = largest * (1 - step / config.grid)
            candidate = torch.maximum(torch.minimum(rows, limit), -limit)
            d = (fake_quantize(candidate.view(len(rows), -1), group_size).view_as(rows) - rows).transpose(0, 1)
            error = ((d @ gram) * d).sum(dim=-1).transpose(0, 1).unsqueeze(-1)  # [rows, groups, 1]
            better = error < best_error
            best_error, best_max = torch.where(better, error, best_error), torch.where(better, limit, best_max)
        clipped[start : start + 2048] = torch.maximum(torch.minimum(rows, best_max), -best_max).view(-1, in_features)
    return clipped
