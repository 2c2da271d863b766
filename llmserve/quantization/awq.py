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
[-m, m], m in (0.5, 1] x max|w|, with the least output error of that linear. A clip lowers every linear's
own output error (on held-out text too), yet on Qwen2.5-Coder-0.5B clipping gate/up raised perplexity by 6 %
(benchmarks/README.md): a linear's error is not the model's. So the clips are kept by kind of linear (v,
o, gate/up, down), one kind at a time, where they lower the quantized model's loss on the calibration text.

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
    # kind of linear -> the quantized model's calibration loss with that kind's clips kept (and the kinds
    # kept before it), tried in CLIP_KINDS order after "none"; clipped: the kinds kept
    clip_losses: dict[str, float] = field(default_factory=dict)
    clipped: list[str] = field(default_factory=list)


# the linears a clip applies to, by kind (q and k are never clipped: AutoAWQ, their errors go through the softmax)
CLIP_KINDS = {"v": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
              "down": "mlp.down_proj"}


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
    clips: dict[str, tuple[torch.Tensor, slice | None]] = {}  # parameter name -> its clipped rows, which rows
    for index, layer in enumerate(model.layers):
        xs = _search_layer(index, layer, xs, cos_sins, config, result, clips)
        logger.info("AWQ: layer %d/%d searched (%.0fs)", index + 1, len(model.layers), time.perf_counter() - start)
    if clips:
        result.clipped = _keep_clips_that_pay(model, samples, clips, config.group_size, result.clip_losses)
    for name, linear in _decoder_linears(model):
        groups = fit_groups(linear.weight, config.group_size)
        result.groups[f"{name}.weight"] = groups
        if quantize:
            linear.weight.copy_(groups.dequantize())
    logger.info("AWQ: %d layers searched on %d calibration tokens in %.1fs; clips kept: %s", len(model.layers),
                sum(len(s) for s in samples), time.perf_counter() - start, ", ".join(result.clipped) or "none")
    return result


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """("layers.0.self_attn.qkv_proj", module), ... for every decoder layer's four linears."""
    return [(f"layers.{i}.{part}", layer.get_submodule(part)) for i, layer in enumerate(model.layers)
            for part in CLIP_KINDS.values()]


def _keep_clips_that_pay(model: nn.Module, samples: list[torch.Tensor], clips: dict[str, tuple[torch.Tensor,
                         slice | None]], group_size: int, losses: dict[str, float]) -> list[str]:
    """The kinds of linear whose clips lower the int4 model's loss on `samples`, tried one kind at a time
    (greedy, in CLIP_KINDS order); the linears are left at full precision with the kept kinds' clips.
    Memory: the clips are kept as limits (one per group), and each trial swaps in new int4-rounded weights
    while the full-precision ones wait aside (not a second copy of the model)."""
    linears = _decoder_linears(model)
    dense = {name: linear.weight for name, linear in linears}

    def weights(kinds: set[str], name: str) -> torch.Tensor:
        w = dense[name].detach()
        if any(name.endswith(CLIP_KINDS[k]) for k in kinds) and name in clips:
            limits, rows = clips[name]
            w = w.clone()
            part = rows if rows is not None else slice(None)
            w[part] = apply_clip(w[part], limits)
        return w

    def loss(kinds: set[str]) -> float:
        for name, linear in linears:
            linear.weight = nn.Parameter(fake_quantize(weights(kinds, name), group_size), requires_grad=False)
        total, count = 0.0, 0
        for ids in samples:
            logits = model.lm_head(causal_forward(model, ids)).float()
            total += nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
            count += len(ids) - 1
        return total / count

    kept: set[str] = set()
    losses["none"] = best = loss(kept)
    for kind in CLIP_KINDS:
        losses[kind] = trial = loss(kept | {kind})
        if trial < best:
            kept.add(kind)
            best = trial
    for name, linear in linears:
        linear.weight = dense[name]
        linear.weight.copy_(weights(kept, name))
    logger.info("AWQ: calibration loss (nats/token) without clips %.4f; %s", losses["none"],
                ", ".join(f"+{k} {losses[k]:.4f}" for k in CLIP_KINDS))
    return [k for k in CLIP_KINDS if k in kept]


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


def _search_layer(index: int, layer: nn.Module, xs: list[torch.Tensor], cos_sins: list, config: AWQConfig,
                  result: AWQResult, clips: dict[str, tuple[torch.Tensor, slice | None]]) -> list[torch.Tensor]:
    """One decoder layer: its scales searched and folded, and (config.clip) each linear's clipped weight
    found, into `clips`, not applied. Returns its full-precision outputs (the next layer's calibration
    inputs)."""
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

    if config.clip:
        inputs = {"self_attn.qkv_proj": (a, v_rows), "self_attn.o_proj": (o, None), "mlp.gate_up_proj": (h, None),
                  "mlp.down_proj": (g, None)}
        for name, (x, rows) in inputs.items():
            w = layer.get_submodule(name).weight
            clips[f"layers.{index}.{name}"] = (clip_limits(w[rows] if rows is not None else w, x,
                                                           config.group_size, config), rows)
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


def clip_limits(w: torch.Tensor, x: torch.Tensor, group_size: int, config: AWQConfig) -> torch.Tensor:
    """m [out, in / group_size]: per group of `group_size` weights of w [out, in], the clamp [-m, m] whose
    int4 rounding gives the least mean squared output error on the inputs x [N, in] (`apply_clip` clamps).
    A group's error is d^T G d, d its rounding error
    and G = x^T x / N over that group's inputs: AutoAWQ's error (sum over the group's products, squared,
    averaged over tokens), on every calibration token, computed as a product per group."""
    out_features, in_features = w.shape
    n_groups = in_features // group_size
    xg = x.float().view(-1, n_groups, group_size).transpose(0, 1)  # [groups, N, gs]
    gram = xg.transpose(1, 2) @ xg / x.shape[0]  # [groups, gs, gs]
    limits = torch.empty(out_features, n_groups, dtype=torch.float32)
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
        limits[start : start + 2048] = best_max.squeeze(-1)
    return limits


def apply_clip(w: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """w [out, in] clamped to [-m, m] per group, m from `clip_limits` [out, in / group size]."""
    m = limits.repeat_interleave(w.shape[1] // limits.shape[1], dim=1).to(w.dtype)
    return torch.maximum(torch.minimum(w, m), -m)
