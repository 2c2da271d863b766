"""int8 activations x int8 weights for the steps that carry many tokens (SmoothQuant's W8A8).

Why: once a step carries a few dozen tokens (a busy server's decode batch, any prompt chunk) the
linears are compute-bound, and an int8 x int8 GEMM (VNNI, oneDNN) runs faster than the prepacked bf16 one;
on CPUs with AMX our own kernel (`kernels/int8_gemm.cpp`) does the same product, bit for bit, faster again
(docs/performance.md, "Large steps: int8 activations and dense products").
Steps of few tokens keep the weight-only kernels: they are bound by the bytes of weight they read, and
int4 reads fewer.

Activations get one scale per token, so a row's result never depends on the rows batched with it.
Per-token scales alone cost perplexity (outlier channels take the whole int8 range); SmoothQuant moves that
range into the weights first: x W^T = (x / s)(W s)^T with s_j = max|x_j|^a / max|W_j|^(1-a), the channel maxima
measured once at load on a fixed calibration text, with a = 0.7 (what it costs over int4:
docs/performance.md, "Large steps: int8 activations and dense products").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)
from torch import nn

SMOOTHING_ALPHA = 0.7
# Varied prompts (questions, code, arithmetic, prose): what the channel maxima are measured on.
CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")


def calibration_prompts() -> list[str]:
    """The calibration text's paragraphs, one prompt each."""
    return [p.strip() for p in CALIBRATION_TEXT.read_text().split("\n\n") if p.strip()]


def smoothing_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel s: divide the activations by it, multiply the weight's columns."""
    act = act_absmax.float().clamp(min=1e-5)
    w = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return act.pow(alpha) / w.pow(1 - alpha)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row: x ~ q * scale, q in [-127, 127]."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of an int8 [out, in] weight: unpacked, every call reorders it (slower, with the
    weights streamed from memory, as in a step)."""
    return torch.ops.onednn.qlinear_prepack(weight, None)


def int8_linear(
    x: torch.Tensor,
    smooth_inv: torch.Tensor,
    weight: torch.Tensor | None,
    weight_scales: torch.Tensor,
    weight_zeros: torch.Tensor,
    packed: torch.Tensor | None,
    native_quantize: bool = False,
    amx: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, in] times a smoothed int8 weight [out, in] (per output channel scales, zero points all 0;
    `packed` its `pack_int8_weight`), in x's dtype. The int32 sums are exact: this is the float product
    of the quantized values, to float32 rounding. `native_quantize`: eager calls quantize x with
    `llmserve::quantize_activations_u8` (loaded by the caller), bit for bit the ops below in one.
    `amx`: the weight as `pack_int8_for_amx` gives it; the product runs on `llmserve::int8_gemm` (eager
    and compiled alike), bit for bit oneDNN's, faster on a step's streamed weights; `weight` and
    `packed` are then unused. Compiled code then quantizes through the native op too: Inductor's own
    loops for it take longer than the op, and compiled and eager steps compute the same bits.

    Activations go in as uint8 around 128 (VNNI and AMX multiply unsigned by signed bytes). Compiled
    without `amx`, the product is written as its dequantized form, which Inductor's freezing turns back
    into this same oneDNN call on a weight it packs itself."""
    compiling = torch.compiler.is_compiling()
    if native_quantize and (amx is not None or (not compiling and packed is not None)):  # one op, same bits
        xu, row_scales = torch.ops.llmserve.quantize_activations_u8(x, smooth_inv)
    else:
        xs = x.float() * smooth_inv
        row_scales = xs.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        xu = (torch.round(xs / row_scales) + 128).clamp(1, 255).to(torch.uint8)
    if amx is not None:
        return torch.ops.llmserve.int8_gemm(xu, row_scales, amx[0], weight_scales, amx[1], x.dtype)
    if compiling or packed is None:
        decomposed = torch.ops.quantized_decomposed
        xd = decomposed.dequantize_per_tensor.default(xu, 1.0, 128, 0, 255, torch.uint8)
        wd = decomposed.dequantize_per_channel.default(weight, weight_scales, weight_zeros, 0, -128, 127, torch.int8)
        y = nn.functional.linear(xd, wd)
    else:
        y = torch.ops.onednn.qlinear_pointwise(
            xu, 1.0, 128, packed, weight_scales, weight_zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
    return (y * row_scales).to(x.dtype)


@contextmanager
def record_input_ranges(layers: dict[str, nn.Module]) -> Iterator[dict[str, torch.Tensor]]:
    """While open, the largest |input| per channel each layer sees, by name."""
    absmax: dict[str, torch.Tensor] = {}

    def recorder(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
            absmax[name] = torch.maximum(absmax[name], seen) if name in absmax else seen
        return hook

    handles = [layer.register_forward_pre_hook(recorder(name)) for name, layer in layers.items()]
    try:
        yield absmax
    finally:
        for handle in handles:
            handle.remove()
