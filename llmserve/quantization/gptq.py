"""GPTQ (Frantar et al. 2022): int4 groups rounded one input column at a time, each column's rounding error spread
over the columns not yet rounded by the inverse Hessian of the layer's calibration inputs.

Why: round to nearest rounds every weight on its own; GPTQ minimizes each linear's output error on real inputs,
||W X - Q X||^2, greedily: after column j is rounded, the remaining columns move by -err_j H^-1[j, j:] / H^-1[j, j]
(H = 2 X X^T / n, its Cholesky factor computed once), so later columns absorb what earlier ones lost. Following the
reference implementation: columns in blocks of 128 with the update outside a block applied once per block (lazy
batch updates); a group's scale and zero point fitted when the pass reaches the group, on the weights as updated by
then; dampening of `damp_percent` of H's mean diagonal; dead inputs (never active) zeroed. Act order (`act_order`)
rounds the columns with the largest H diagonal first; its groups are static (fitted on the original weights before
the pass, as AutoGPTQ's `static_groups`), so each group is still a run of contiguous inputs and the result runs on
our int4 kernels exactly (loader/gptq_format.py).

Sequential as AutoGPTQ's `true_sequential`: layer by layer, and inside a layer q/k/v, then o, then gate/up, then
down, each linear's Hessian from inputs computed with everything before it already quantized, so a linear
compensates for the errors upstream of it. The rows of a fused linear (q/k/v, gate/up) share their input and so
their Hessian: rounding them together is rounding each apart. Scales are rounded to fp16 before they are used, so the
written checkpoint holds exactly what the search computed with.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.layers.mlp import GatedMLP
from llmserve.quantization.int4_groups import MAX_Q, Int4Groups, check_group_size

logger = logging.getLogger(__name__)

# the order a layer's linears are quantized in: each one's inputs come from the layer with the ones before it
# already on their groups
SEQUENCE = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_BLOCK = 128  # columns per lazy-batch update (the reference implementation's)
# fewer calibration tokens than this many per input of the widest linear: a warning. On the shipped text's 1.7k tokens
# GPTQ fell behind round to nearest on SmolLM2 and Qwen2.5-Coder-0.5B; on 5k tokens of text like the evaluated it led
# round to nearest and AWQ on Qwen (docs/quantization.md, "GPTQ")
FEW_TOKENS_PER_INPUT = 4


@dataclass(frozen=True)
class GPTQConfig:
    group_size: int = 128  # inputs per scale and zero point (a multiple of 32: our kernels' group)
    # a zero point per group (our int4 kernels hold them at no cost; on the Lee corpus they beat symmetric groups by
    # 6-12 % perplexity); True: zero point 8 everywhere, AutoGPTQ's default and the only kind vLLM's Marlin kernels take
    sym: bool = False
    act_order: bool = False  # columns by decreasing Hessian diagonal, with static groups
    damp_percent: float = 0.01  # of the Hessian's mean diagonal, added to it
    max_seq_len: int = 512  # calibration sequence length in tokens

    def __post_init__(self) -> None:
        check_group_size(self.group_size)
        if not 0 < self.damp_percent < 1:
            raise ValueError(f"GPTQ damp_percent must be in (0, 1), got {self.damp_percent}")
        if self.max_seq_len < 2:
            raise ValueError(f"GPTQ max_seq_len must be >= 2, got {self.max_seq_len}")


@torch.no_grad()
def gptq_quantize(model: nn.Module, samples: list[torch.Tensor], config: GPTQConfig) -> dict[str, Int4Groups]:
    """Every decoder linear of `model` (our dense `DecoderForCausalLM`, float32 for precise Hessians) on GPTQ's int4
    groups, in place (the linears then hold the dequantized values). Returns the groups by parameter name
    ("layers.0.mlp.down_proj.weight")."""
    if not all(isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        raise ValueError("GPTQ quantizes dense layers only: this model's feed-forward layers are mixtures of experts "
                         "(quantize it with int4 or int8 instead)")
    start = time.perf_counter()
    tokens, widest = sum(len(s) for s in samples), max(layer.mlp.down_proj.weight.shape[1] for layer in model.layers)
    if tokens < FEW_TOKENS_PER_INPUT * widest:
        logger.warning("GPTQ: %d calibration tokens for linears of up to %d inputs. GPTQ fits each weight to its "
                       "calibration inputs, and on too few it can do worse than round to nearest on other text "
                       "(docs/quantization.md, GPTQ): calibrate on more text like what the model will serve "
                       "(`llmserve quantize --calibration FILE`)", tokens, widest)
    groups: dict[str, Int4Groups] = {}
    with model.whole_sequence():
        dtype = model.embed_tokens.weight.dtype
        ropes = [model.rope_tables(torch.arange(len(ids)), dtype) for ids in samples]
        xs = [model.embed(ids) for ids in samples]
        for index, layer in enumerate(model.layers):
            for name in SEQUENCE:
                linear = layer.get_submodule(name)
                g = gptq_linear(linear.weight, _hessian(layer, linear, xs, ropes), config)
                linear.weight.copy_(g.dequantize().to(linear.weight.dtype))
                groups[f"layers.{index}.{name}.weight"] = g
            xs = [layer(x, rope, (None, None), None) for x, rope in zip(xs, ropes, strict=True)]
            logger.info("GPTQ: layer %d/%d quantized (%.0fs)", index + 1, len(model.layers),
                        time.perf_counter() - start)
    logger.info("GPTQ: %d layers on %d calibration tokens in %.1fs", len(model.layers), tokens,
                time.perf_counter() - start)
    return groups


def _hessian(layer: nn.Module, linear: nn.Module, xs: list[torch.Tensor], ropes: list) -> torch.Tensor:
    """2 X^T X / n over `linear`'s inputs when `layer` runs on `xs` (float32 [in, in])."""
    in_features = linear.weight.shape[1]
    h = torch.zeros(in_features, in_features)
    count = 0

    def accumulate(module: nn.Module, args: tuple) -> None:
        nonlocal count
        x = args[0].reshape(-1, in_features).float()
        h.addmm_(x.t(), x)
        count += len(x)

    handle = linear.register_forward_pre_hook(accumulate)
    try:
        for x, rope in zip(xs, ropes, strict=True):
            layer(x, rope, (None, None), None)
    finally:
        handle.remove()
    return h.mul_(2 / max(count, 1))


def gptq_linear(weight: torch.Tensor, hessian: torch.Tensor, config: GPTQConfig) -> Int4Groups:
    """One weight [out, in] on int4 groups by GPTQ, given its inputs' Hessian [in, in]."""
    w = weight.detach().float().clone()
    out_features, in_features = w.shape
    check_group_size(config.group_size, in_features)
    h = hessian.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    g = config.group_size
    n_groups = in_features // g
    scales = torch.empty(out_features, n_groups)
    zeros = torch.empty(out_features, n_groups, dtype=torch.int32)
    if config.act_order:  # static groups: every group fitted on the weights before any column moves
        for j in range(n_groups):
            scales[:, j], zeros[:, j] = _fit(w[:, j * g : (j + 1) * g], config.sym)
        order = torch.argsort(torch.diag(h), descending=True, stable=True)
    else:
        order = torch.arange(in_features)
    w, h = w[:, order], h[order][:, order]
    h.diagonal().add_(config.damp_percent * torch.mean(torch.diag(h)))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(out_features, in_features, dtype=torch.int32)  # in the pass's column order
    group_of = order // g  # each pass column's group
    block = g * math.ceil(_BLOCK / g)  # a whole number of groups: a group is fitted inside one block
    for i1 in range(0, in_features, block):
        i2 = min(i1 + block, in_features)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.empty(out_features, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = i1 + i
            if not config.act_order and column % g == 0:  # the group's columns as updated so far
                scales[:, column // g], zeros[:, column // g] = _fit(w1[:, i : i + g], config.sym)
            s, z = scales[:, group_of[column]], zeros[:, group_of[column]]
            qc = torch.clamp(torch.round(w1[:, i] / s) + z, 0, MAX_Q)
            q[:, column] = qc.to(torch.int32)
            err = (w1[:, i] - (qc - z) * s) / hinv1[i, i]
            w1[:, i:].addr_(err, hinv1[i, i:], alpha=-1)
            err1[:, i] = err
        w[:, i2:].addmm_(err1, hinv[i1:i2, i2:], alpha=-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(in_features)
    return Int4Groups(q[:, inverse].contiguous(), scales, zeros, g)


def _fit(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's quantizer per row of a group [out, g]: the range [min(w, 0), max(w, 0)] (symmetric: +-max|w|, zero
    point 8) in 15 steps; the scale rounded to fp16 first (what is stored) and the zero point to an integer."""
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = ((hi - lo) / MAX_Q).half().float().clamp(min=2**-24)
    zero = torch.full_like(scale, (MAX_Q + 1) // 2) if sym else torch.round(-lo / scale).clamp(0, MAX_Q)
    return scale, zero.to(torch.int32)
