"""int4 weights: groups of 32 inputs, w = q * scale + min, q in [0, 15] (GGUF's Q4_1 scheme).

A weight the file stored on a 4-bit grid (Q4_0, Q4_1, Q4_K: the loader's `int4_grids`) keeps that grid, so the int4
path computes with the values shipped (Q4_K's scales and minimums, products of an fp16 and a 6-bit integer, exactly:
the native kernel keeps them as such, in its super-block layout, 4.625 bits a weight; `pack_int4`); any other weight
gets a grid fitted to it (scale = (max - min) / 15, min = the group's minimum, both fp16 values). AWQ's groups (any
multiple of 32 inputs, w = (q - z) * s: an AWQ checkpoint's, or `--quantization awq`'s) arrive the same way, as
`int4_grids` (quantization/int4_groups.py). Small steps run `kernels/quantized_gemv.cpp`'s `int4_gemv` where it is
built, else PyTorch's `_weight_int4pack_mm_for_cpu`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmserve.kernels.quantized_gemv import SuperBlocks, int4_packs, pack_int4, super_blocks
from llmserve.quantization.methods.base import LinearMethod, PreparedWeight, SmallStep, native_levels

INT4_GROUP_SIZE = 32


class Int4Method(LinearMethod):
    def native_packs(self, out_features: int, in_features: int) -> bool:
        return int4_packs(out_features, in_features)

    def prepare(self, weight: torch.Tensor, grid: tuple[torch.Tensor, ...] | None, native: bool,
                dense: bool = True) -> PreparedWeight:
        # (the levels' op makes the dequantized values in the same pass, whether kept or not)
        q, scales, mins, dequantized, blocks = quantize_int4(weight, grid, native)
        if native:
            return PreparedWeight(pack_int4(q, scales, mins, blocks), None, dequantized,
                                  "groups of 32" if blocks is None else "super-blocks")
        return PreparedWeight(*_torch_int4_pack(q, scales, mins, weight.dtype), dequantized, "groups of 32")

    def small_step(self, native: bool) -> SmallStep:
        return _native_int4 if native else _torch_int4


def _native_int4(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.llmserve.int4_gemv(x, layer.qweight, layer.out_features, layer.activation_parts)


def _torch_int4(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch._weight_int4pack_mm_for_cpu(x, layer.qweight, INT4_GROUP_SIZE, layer.scales)


class Int4Levels(NamedTuple):
    q: torch.Tensor  # [out, in] integers in [0, 15]: int32 (PyTorch's ops) or uint8 (the native op)
    scale: torch.Tensor  # [out, in / 32] float32, as the kernel holds them
    lo: torch.Tensor
    dequantized: torch.Tensor  # [out, in], float32 (PyTorch's ops) or the weight's dtype (the native op)
    blocks: SuperBlocks | None  # scale and lo as super-block factors (`super_blocks`), or None: fp16 values


def quantize_int4(w: torch.Tensor, grid: tuple[torch.Tensor, ...] | None = None, native: bool = False) -> Int4Levels:
    """Asymmetric per group of 32 inputs (Q4_1): w ~ q * scale + min, q in [0, 15], scale and min fp16
    values, or exact where they factor into super-blocks (Q4_K's); `grid` (scale, min) [out, in / 32] when the
    file has one, else fitted to each group. `native`: the kernels are loaded; their `int4_levels` computes
    the same levels and values in one pass over w, in w's dtype."""
    out_features, in_features = w.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(f"int4 needs input features divisible by {INT4_GROUP_SIZE}, got {in_features}")
    w = w.detach()
    native = native_levels(w, native)
    groups = w.view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    if grid is None:  # fitted: the group's range in 15 steps, as fp16 values (a minimum is exact in any dtype)
        lo, hi = groups.amin(dim=-1).float(), groups.amax(dim=-1).float()
        exact_scale, exact_lo = ((hi - lo) / 15).clamp(min=1e-7).half().float(), lo.half().float()
    else:  # the file's own: its levels are exact whatever the rounding of w since (a zero scale: one level)
        exact_scale, exact_lo = (g.float().contiguous() for g in grid)
    blocks = super_blocks(exact_scale, exact_lo)
    if blocks is None:
        scale, lo = exact_scale.half().float(), exact_lo.half().float()
    else:  # the kernel's super-block layout holds them exactly (Q4_K's)
        scale, lo = exact_scale, exact_lo
    if native:
        q, dequantized = torch.ops.llmserve.int4_levels(w.contiguous(), exact_scale, exact_lo, scale, lo)
        return Int4Levels(q, scale, lo, dequantized, blocks)
    step = torch.where(exact_scale > 0, exact_scale, torch.ones_like(exact_scale))
    # in place after the first op (each fresh [out, in] tensor pays its page faults: start-up time)
    q = torch.sub(groups.float(), exact_lo[..., None]).div_(step[..., None]).round_().clamp_(0, 15)
    dequantized = torch.mul(q, scale[..., None]).add_(lo[..., None]).view(out_features, in_features)
    return Int4Levels(q.to(torch.int32).view(out_features, in_features), scale, lo, dequantized, blocks)


def _torch_int4_pack(
    q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's int4 layout: the kernel's form is (q - 8) * scale + zero, so zero = min + 8 * scale;
    scales and zeros are packed as [in / 32, out, 2]."""
    scales_and_zeros = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros
