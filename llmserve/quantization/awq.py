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
own output error (on held-out text too), yet on Qwen2.5-Coder-0.5B clipping gate/up raised perplexity
(docs/performance.md, "Weight quantization quality"): a linear's error is not the model's. The scales showed the
same on that model (each block's error lower, perplexity higher than round to nearest). So both are kept by kind,
one kind at a time, only where they lower the int4 model's loss on the calibration text: first the scales (qkv, o,
gate/up, down), then, on the model with the kept scales folded, the clips (v, o, gate/up, down), whose
search runs in a second pass over the layers for that reason.

The groups of AutoAWQ's Llama/Qwen2 recipe (awq/models/llama.py): q/k/v after input_layernorm (error
measured on the attention block's output), gate/up after post_attention_layernorm (on the MLP's output),
o after v (only where there is one v head per query head: with grouped heads one v channel feeds several
o channels), down after up. Searches run on the full-precision layer; each layer's calibration inputs are
the full-precision model's (the previous layer before quantization).

The model runs its own serving forward over whole sequences (`DecoderForCausalLM.whole_sequence`), and each
linear's inputs are read by hooks: every dense family's norms, windows and rotary tables are the ones searched
(Gemma 3's scales fold into its pre-feed-forward norm, through its unit offset). Experts are not searched: a
mixture-of-experts model is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from llmserve.layers.mlp import GatedMLP
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
    # keep a kind's scales (and clips) only where they lower the int4 model's calibration loss; False: all
    # of them, as AutoAWQ does
    select_by_loss: bool = True

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
    # kind -> the int4 model's calibration loss with that kind's scales (clips) kept, and the kinds kept
    # before it, tried in SCALE_KINDS (CLIP_KINDS) order after "none"; scaled / clipped: the kinds kept
    scale_losses: dict[str, float] = field(default_factory=dict)
    scaled: list[str] = field(default_factory=list)
    clip_losses: dict[str, float] = field(default_factory=dict)
    clipped: list[str] = field(default_factory=list)


# the linear each block's scales multiply (its input columns), by block
SCALE_KINDS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
               "down": "mlp.down_proj"}
# the linears a clip applies to, by kind (q and k are never clipped: AutoAWQ, their errors go through the softmax)
CLIP_KINDS = {"v": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
              "down": "mlp.down_proj"}


def calibration_samples(tokenizer, max_seq_len: int, text: str | None = None) -> list[torch.Tensor]:
    """The calibration text (default quantization/calibration.txt: questions, code, arithmetic, prose) as token
    sequences of at most `max_seq_len` tokens (the whole text, cut in order)."""
    ids = tokenizer.encode("\n\n".join(calibration_prompts()) if text is None else text, add_special_tokens=False)
    return [torch.tensor(ids[i : i + max_seq_len]) for i in range(0, len(ids), max_seq_len) if len(ids) - i >= 2]


@torch.no_grad()
def awq_quantize(model: nn.Module, samples: list[torch.Tensor], config: AWQConfig,
                 quantize: bool = True) -> AWQResult:
    """Search and fold the scales, clip, and fit the int4 groups of every decoder linear of `model` (our
    dense `DecoderForCausalLM` on PyTorch ops, float32 for a precise search), in place. `quantize`: the
    linears then hold their dequantized int4 values; False leaves them at full precision (scaled and
    clipped), for checking that the folding keeps the model's function."""
    if not all(isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        raise ValueError("AWQ searches dense layers only: this model's feed-forward layers are mixtures of experts "
                         "(quantize it with int4 or int8 instead)")
    with model.whole_sequence():
        return _awq(model, samples, config, quantize)


def _awq(model: nn.Module, samples: list[torch.Tensor], config: AWQConfig, quantize: bool) -> AWQResult:
    start = time.perf_counter()
    result = AWQResult({})
    dtype = model.embed_tokens.weight.dtype
    ropes = [model.rope_tables(torch.arange(len(ids)), dtype) for ids in samples]
    embedded = [model.embed(ids) for ids in samples]
    xs = embedded
    for index, layer in enumerate(model.layers):
        xs = _search_layer(index, layer, xs, ropes, config, result)
        logger.info("AWQ: layer %d/%d searched (%.0fs)", index + 1, len(model.layers), time.perf_counter() - start)
    result.scaled = _keep_scales_that_pay(model, samples, result.searches, config.group_size, result.scale_losses,
                                          config.select_by_loss)
    for s in result.searches:
        if s.block in result.scaled:
            _fold_block(model.layers[s.layer], s.block, s.scales)
    if config.clip:
        clips: dict[str, tuple[torch.Tensor, slice | None]] = {}  # parameter name -> its clip limits, which rows
        xs = embedded
        for index, layer in enumerate(model.layers):  # the second pass: the clips see the folded scales
            xs = _clip_layer(index, layer, xs, ropes, config, clips)
        result.clipped = _keep_clips_that_pay(model, samples, clips, config.group_size, result.clip_losses,
                                              config.select_by_loss)
    for name, linear in _decoder_linears(model):
        groups = fit_groups(linear.weight, config.group_size)
        result.groups[f"{name}.weight"] = groups
        if quantize:
            linear.weight.copy_(groups.dequantize())
    logger.info("AWQ: %d layers searched on %d calibration tokens in %.1fs; scales kept: %s; clips kept: %s",
                len(model.layers), sum(len(s) for s in samples), time.perf_counter() - start,
                ", ".join(result.scaled) or "none", ", ".join(result.clipped) or "none")
    return result


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """("layers.0.self_attn.qkv_proj", module), ... for every decoder layer's four linears."""
    return [(f"layers.{i}.{part}", layer.get_submodule(part)) for i, layer in enumerate(model.layers)
            for part in CLIP_KINDS.values()]


def _keep_clips_that_pay(model: nn.Module, samples: list[torch.Tensor], clips: dict[str, tuple[torch.Tensor,
                         slice | None]], group_size: int, losses: dict[str, float], select: bool = True) -> list[str]:
    """The kinds of linear whose clips lower the int4 model's loss on `samples` (`select`; else all kinds);
    the linears are left at full precision with the kept kinds' clips. Memory: the clips are kept as limits
    (one per group)."""
    linears = _decoder_linears(model)

    def weights(kinds: set[str], name: str, w: torch.Tensor) -> torch.Tensor:
        if any(name.endswith(CLIP_KINDS[k]) for k in kinds) and name in clips:
            limits, rows = clips[name]
            w = w.clone()
            part = rows if rows is not None else slice(None)
            w[part] = apply_clip(w[part], limits)
        return w

    kept = (_greedy_by_loss(model, samples, list(CLIP_KINDS), lambda kinds, name, w: fake_quantize(
        weights(kinds, name, w), group_size), losses, "clips") if select else set(CLIP_KINDS))
    for name, linear in linears:
        linear.weight.copy_(weights(kept, name, linear.weight.detach()))
    return [k for k in CLIP_KINDS if k in kept]


def _keep_scales_that_pay(model: nn.Module, samples: list[torch.Tensor], searches: list[BlockSearch],
                          group_size: int, losses: dict[str, float], select: bool = True) -> list[str]:
    """The blocks whose scales lower the int4 model's loss on `samples`, tried one kind at a time (`select`;
    else every block searched). Nothing is folded here."""
    kinds = [k for k in SCALE_KINDS if any(s.block == k for s in searches)]
    kept = (_greedy_by_loss(model, samples, kinds, scaled_int4_weight(model, searches, group_size), losses,
                            "scales") if select else set(kinds))
    return [k for k in kinds if k in kept]


def scaled_int4_weight(model: nn.Module, searches: list[BlockSearch], group_size: int
                       ) -> Callable[[set[str], str, torch.Tensor], torch.Tensor]:
    """f(kinds, linear name, its dense weight): the int4 weight the model folded with those kinds' scales
    would have, mapped back (its columns divided by its own scales, the rows a later block's scales divide
    multiplied back), so the unfolded model (norms untouched) computes what the folded one would."""
    by_linear: dict[str, list[tuple[str, torch.Tensor, slice | None]]] = {}  # linear -> (kind, s, rows or None)
    for s in searches:
        layer = model.layers[s.layer]
        by_linear.setdefault(f"layers.{s.layer}.{SCALE_KINDS[s.block]}", []).append((s.block, s.scales, None))
        before = _scaled_rows(layer, s.block)
        if before is not None:
            by_linear.setdefault(f"layers.{s.layer}.{before[0]}", []).append((s.block, s.scales, before[1]))

    def int4_weight(kept: set[str], name: str, w: torch.Tensor) -> torch.Tensor:
        scales = [(s, rows) for kind, s, rows in by_linear.get(name, []) if kind in kept]
        if not scales:
            return fake_quantize(w, group_size)
        w = w.clone()
        for s, rows in scales:
            _rescale(w, s, rows)
        w = fake_quantize(w, group_size)
        for s, rows in scales:
            _rescale(w, 1 / s, rows)
        return w

    return int4_weight


def _rescale(w: torch.Tensor, s: torch.Tensor, rows: slice | None) -> None:
    """In place, as folding s changes a linear: its input columns times s (rows None: s is its own input's
    scale), or those rows divided by s (they make the input of the block s belongs to)."""
    if rows is None:
        w.mul_(s)
    else:
        w[rows] /= s.view(-1, 1)


def _greedy_by_loss(model: nn.Module, samples: list[torch.Tensor], kinds: list[str],
                    int4_weight: Callable[[set[str], str, torch.Tensor], torch.Tensor], losses: dict[str, float],
                    what: str) -> set[str]:
    """The kinds kept by a greedy pass (in `kinds` order): a kind stays where the int4 model with it (and
    the kinds kept before it) has a lower calibration loss. `int4_weight(kinds, name, dense weight)` is a
    linear's int4-rounded weight with those kinds applied. Each trial swaps in new weights while the
    full-precision ones wait aside (not a second copy of the model); they are put back at the end."""
    linears = _decoder_linears(model)
    dense = {name: linear.weight for name, linear in linears}

    def loss(kept: set[str]) -> float:
        for name, linear in linears:
            linear.weight = nn.Parameter(int4_weight(kept, name, dense[name].detach()), requires_grad=False)
        total, count = 0.0, 0
        for ids in samples:
            logits = model.lm_head(model.forward_sequence(ids)).float()
            total += nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
            count += len(ids) - 1
        return total / count

    kept: set[str] = set()
    losses["none"] = best = loss(kept)
    for kind in kinds:
        losses[kind] = trial = loss(kept | {kind})
        if trial < best:
            kept.add(kind)
            best = trial
    for name, linear in linears:
        linear.weight = dense[name]
    logger.info("AWQ: calibration loss (nats/token) without %s %.4f; %s", what, losses["none"],
                ", ".join(f"+{k} {losses[k]:.4f}" for k in kinds))
    return kept


def _layer_inputs(layer: nn.Module, xs: list[torch.Tensor], ropes: list) -> tuple[dict[str, torch.Tensor],
                                                                                   list[torch.Tensor], list]:
    """One decoder layer at full precision (the model within `whole_sequence`): each linear's calibration inputs
    (all sequences, concatenated), q/k/v's inputs per sequence (for the attention block), and the layer's outputs
    (the next layer's calibration inputs)."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in SCALE_KINDS.values()}

    def recorder(name: str) -> Callable:
        return lambda module, args: seen[name].append(args[0])

    handles = [layer.get_submodule(name).register_forward_pre_hook(recorder(name)) for name in seen]
    try:
        outputs = [layer(x, rope, (None, None), None) for x, rope in zip(xs, ropes, strict=True)]
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(t) for name, t in seen.items()}, seen[SCALE_KINDS["qkv"]], outputs


def _search_layer(index: int, layer: nn.Module, xs: list[torch.Tensor], ropes: list, config: AWQConfig,
                  result: AWQResult) -> list[torch.Tensor]:
    """One decoder layer's scale searches (into `result.searches`; nothing folded). Returns its
    full-precision outputs."""
    attn, mlp = layer.self_attn, layer.mlp
    inputs, normed, outputs = _layer_inputs(layer, xs, ropes)
    a, o, h, g = (inputs[name] for name in SCALE_KINDS.values())

    def attention_block() -> torch.Tensor:
        return torch.cat([layer.attend(n, rope, (None, None), None) for n, rope in zip(normed, ropes, strict=True)])

    searches = {  # block -> (its linear, its input, the block's output as a function of the linear's weight)
        "qkv": (attn.qkv_proj, a, attention_block),
        "gate_up": (mlp.gate_up_proj, h, lambda: mlp(h)),
        "down": (mlp.down_proj, g, lambda: mlp.down_proj(g)),
    }
    if attn.num_heads == attn.num_kv_heads:
        searches["o"] = (attn.o_proj, o, lambda: attn.o_proj(o))
    for block, (linear, x, inspect) in searches.items():
        s, search = _search_scales(linear, x, inspect, config)
        result.searches.append(BlockSearch(index, block, *search, scales=s))
    return outputs


def _clip_layer(index: int, layer: nn.Module, xs: list[torch.Tensor], ropes: list, config: AWQConfig,
                clips: dict[str, tuple[torch.Tensor, slice | None]]) -> list[torch.Tensor]:
    """Each linear's clip limits on its (scaled) calibration inputs, into `clips`, not applied. Returns the
    layer's full-precision outputs."""
    inputs, _normed, outputs = _layer_inputs(layer, xs, ropes)
    for name, x in inputs.items():
        rows = _v_rows(layer) if name == SCALE_KINDS["qkv"] else None
        w = layer.get_submodule(name).weight
        clips[f"layers.{index}.{name}"] = (clip_limits(w[rows] if rows is not None else w, x, config.group_size,
                                                       config), rows)
    return outputs


def _scaled_rows(layer: nn.Module, block: str) -> tuple[str, slice] | None:
    """(the linear, its rows) that make block's input where that is a linear (o: v's rows of qkv_proj; down:
    up's rows of gate_up_proj); None where it is a norm."""
    if block == "o":
        return SCALE_KINDS["qkv"], _v_rows(layer)
    if block == "down":
        return SCALE_KINDS["gate_up"], slice(layer.mlp.intermediate_size, None)
    return None


def _v_rows(layer: nn.Module) -> slice:
    """v's rows of the fused qkv_proj."""
    return slice(layer.self_attn.q_size + layer.self_attn.kv_size, None)


def _fold_block(layer: nn.Module, block: str, s: torch.Tensor) -> None:
    """Fold one block's scales into the layer: what makes its input divides by s, its linear's input columns
    multiply by it (the product is unchanged)."""
    before = _scaled_rows(layer, block)
    if before is None:
        norm = layer.input_layernorm if block == "qkv" else layer.mlp_input_norm
        norm.scale_output_(1 / s)
    else:
        linear, rows = layer.get_submodule(before[0]), before[1]
        _rescale(linear.weight, s, rows)
        if linear.bias is not None:
            linear.bias[rows].div_(s)
    _rescale(layer.get_submodule(SCALE_KINDS[block]).weight, s, None)


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
