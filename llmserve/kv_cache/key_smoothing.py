"""Key smoothing for the int8 KV cache: a model's few outsized key channels scaled down before they are
cached, and the matching query channels scaled up, folded into q_proj / k_proj once at load.

Why: an int8 cache row (one token of one KV head) has one scale, so its largest value sets the step for all
head_dim values. Some models put a few key channels far above the rest: in Qwen2.5-Coder-1.5B the largest
channel pair of a head reaches 2^5.7 times the head's typical pair (its k_proj bias), so the other channels
keep only a few of int8's levels and the cache costs perplexity. Keys matter only through q . k, so
dividing a key channel by s and multiplying the same query channel by s leaves every attention score as it
was. Rotary position embedding rotates channel i with channel i + head_dim / 2, so the two share one s, and
s is a power of two: scaling by it is exact in floating point, so with a full-precision cache the model
computes the very same numbers (tested), and only the int8 rounding changes. Folded into the rows of the
fused q/k/v projection (weights, bias, and the file's int4 grid that the int4 kernels take their groups
from), it costs nothing per step, and no kernel or attention path knows of it.

Scaling the outlier pairs to the head's geometric mean recovers most of what the int8 cache costs; scaling every
pair to it (small ones up too) does no better. The fp8 cache gets much worse with the same scales, so only int8
uses them (docs/performance.md, "KV cache quantization"). A likely cause, not verified: e4m3 rounds every value to
~2^-4 of itself except the row's largest, which maps to 448 exactly; unsmoothed, that exact value is the outsized
channel that dominates the scores, smoothed it is rounded like the rest. int8 trades the same exactness for ~30x
finer steps everywhere else.

Models with query/key norms (Qwen3, Gemma 3) are left unsmoothed: each head's keys are normalized after k_proj,
so a channel scale in its rows does not reach the cache, and the norms' weights are shared by every head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.quantization.awq import calibration_samples

CALIBRATION_TOKENS = 1024  # the calibration text's first tokens: key channel maxima settle well before that
MAX_EXPONENT = 6  # s <= 64: past the largest spread measured (2^5.7), and far from fp16's range for the grids


@dataclass(frozen=True)
class KeySmoothing:
    """Per layer, the power of two each KV head's channel pair is divided by, [kv_heads, head_dim // 2]."""

    exponents: list[torch.Tensor]
    seconds: float = 0.0

    @property
    def num_scaled(self) -> int:
        return sum(int((e > 0).sum()) for e in self.exponents)

    def describe(self) -> str:
        total = sum(e.numel() for e in self.exponents)
        largest = max((int(e.max()) for e in self.exponents), default=0)
        return (f"int8 KV cache: keys smoothed, {self.num_scaled} of {total} channel pairs scaled down "
                f"(at most 2^{largest}), calibrated in {self.seconds:.1f}s")


@torch.no_grad()
def key_pair_maxima(model: nn.Module, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """The largest norm of each key channel pair (i, i + head_dim / 2) per KV head and layer over the
    samples, [kv_heads, head_dim // 2] per layer: each sample run through the model as one causal sequence
    (no KV cache). A pair's norm is the same before and after rotary, so it is read at k_proj's output."""
    layers = list(model.layers)
    maxima: list[torch.Tensor | None] = [None] * len(layers)

    def recorder(index: int, attn: nn.Module):
        half = attn.head_dim // 2

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            k = out[:, attn.q_size : attn.q_size + attn.kv_size].float().view(-1, attn.num_kv_heads, attn.head_dim)
            norms = (k[..., :half].square() + k[..., half:].square()).sqrt().amax(dim=0)
            seen = maxima[index]
            maxima[index] = norms if seen is None else torch.maximum(seen, norms)
        return hook

    handles = [layer.self_attn.qkv_proj.register_forward_hook(recorder(i, layer.self_attn))
               for i, layer in enumerate(layers)]
    try:
        for ids in samples:
            model.forward_sequence(ids.to(model.embed_tokens.weight.device))
    finally:
        for handle in handles:
            handle.remove()
    return [m for m in maxima if m is not None]


def smoothing_exponents(maxima: list[torch.Tensor], max_exponent: int = MAX_EXPONENT) -> list[torch.Tensor]:
    """Per pair, e >= 0 with 2^e about its maximum over the head's geometric mean of pair maxima: outsized
    pairs come down to the head's typical size, the others stay as they are (never scaled up, so no query
    channel is scaled down)."""
    out = []
    for m in maxima:
        log2 = m.float().clamp(min=1e-6).log2()
        out.append((log2 - log2.mean(dim=-1, keepdim=True)).round().clamp(0, max_exponent).to(torch.int32))
    return out


def _row_factors(attn: nn.Module, exponents: torch.Tensor) -> torch.Tensor:
    """float32 factors for the fused projection's rows: q heads times s, k heads over s, v heads 1."""
    s = torch.pow(2.0, exponents.float()).repeat(1, 2)  # [kv_heads, head_dim]: pair i and i + half alike
    group = attn.num_heads // attn.num_kv_heads
    return torch.cat([s.repeat_interleave(group, dim=0).flatten(), s.reciprocal().flatten(),
                      torch.ones(attn.kv_size, device=s.device)])


def fold_key_smoothing(model: nn.Module, smoothing: KeySmoothing,
                       grids: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Scale the rows of every layer's fused q/k/v projection (a dense `nn.Linear`, before the build
    quantizes it) and, in `grids` (a checkpoint's `int4_grids`, replaced entry by entry), the int4 grid rows
    of its q_proj and k_proj, so that quantizing afterwards gives the scaled weights exactly."""
    names = {k.removeprefix("model."): k for k in (grids or {})}
    for index, (layer, exponents) in enumerate(zip(model.layers, smoothing.exponents, strict=True)):
        attn = layer.self_attn
        factors = _row_factors(attn, exponents)
        proj = attn.qkv_proj
        proj.weight.mul_(factors.to(proj.weight.dtype).unsqueeze(1))
        if proj.bias is not None:
            proj.bias.mul_(factors.to(proj.bias.dtype))
        q_factors, k_factors, _ = factors.split([attn.q_size, attn.kv_size, attn.kv_size])
        for part, part_factors in (("q_proj", q_factors), ("k_proj", k_factors)):
            name = names.get(f"layers.{index}.self_attn.{part}.weight")
            if name is not None:
                scale, low = grids[name]
                grids[name] = (scale * part_factors.unsqueeze(1), low * part_factors.unsqueeze(1))


def cannot_smooth(model: nn.Module) -> str | None:
    """Why this model's keys cannot be smoothed by k_proj's rows, or None where they can."""
    if any(layer.self_attn.k_norm is not None for layer in model.layers):
        return "its query/key norms renormalize each head after k_proj (a row scale would not reach the cache)"
    return None


@torch.no_grad()
def smooth_keys(model: nn.Module, tokenizer, grids: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                num_tokens: int = CALIBRATION_TOKENS) -> KeySmoothing:
    """Measure the key pair maxima on the calibration text and fold their smoothing into `model` (dense,
    not yet quantized) and `grids`."""
    start = time.perf_counter()
    samples = calibration_samples(tokenizer, num_tokens)[:1]  # one sequence: each linear's weight read once
    smoothing = KeySmoothing(smoothing_exponents(key_pair_maxima(model, samples)))
    fold_key_smoothing(model, smoothing, grids)
    return KeySmoothing(smoothing.exponents, time.perf_counter() - start)
