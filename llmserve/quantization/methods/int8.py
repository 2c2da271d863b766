"""int8 weights: symmetric per output channel, except for a weight the file stored on a grid int8 holds.

Those (`Checkpoint.int8_grids`) keep the file's values: Q6_K (an int8 scale per 16 inputs, an fp16 factor per 256),
which the native kernel reads in a 6-bit layout of its own (`pack_int6`, 6.625 bits a weight, fewer bytes than int8
and exact), or Q8_0 and Q5_0 (an fp16 d per 32 inputs), which it reads as int8 with each group's d
(`pack_int8_grouped`, 8.5 bits a weight, exact). Small steps run `kernels/quantized_gemv.cpp`'s `int8_gemv` where it
is built, else PyTorch's `_weight_int8pack_mm` (per-row weights only: without the native kernel a file-grid weight
takes the dense product of the same values at every step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmserve.kernels.quantized_gemv import (
    INT6_SUB,
    INT6_SUPER,
    int6_packs,
    int8_packs,
    pack_int6,
    pack_int8,
    pack_int8_grouped,
)
from llmserve.quantization.int8_activations import quantize_rows
from llmserve.quantization.methods.base import LinearMethod, PreparedWeight, SmallStep, levels_on
from llmserve.quantization.methods.int4 import INT4_GROUP_SIZE


class Int8Method(LinearMethod):
    def native_packs(self, out_features: int, in_features: int) -> bool:
        return int8_packs(out_features, in_features)

    def prepare(self, weight: torch.Tensor, grid: tuple[torch.Tensor, ...] | None, native: bool,
                dense: bool = True) -> PreparedWeight:
        levels = file_levels(weight, grid, native)
        out_features = weight.shape[0]
        if isinstance(levels, Int6Levels | GroupedLevels):  # native: the 6-bit or grouped layout, row scales ones
            packed = (levels.pack(), torch.ones(out_features)) if native else (None, None)
            return PreparedWeight(*packed, levels.dequantized, "six-bit" if isinstance(levels, Int6Levels) else
                                  "grouped")
        q, scales, dequantized = quantize_int8(weight, dense=dense)
        packed = (pack_int8(q), scales.float()) if native else (q, scales.to(weight.dtype))
        return PreparedWeight(*packed, dequantized, "per row")

    def small_step(self, native: bool) -> SmallStep:
        return _native_int8 if native else _torch_int8


def _native_int8(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.llmserve.int8_gemv(x, layer.qweight, layer.scales, layer.out_features, layer.activation_parts)


def _torch_int8(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, layer.qweight, layer.scales)


def quantize_int8(w: torch.Tensor, rows_at_a_time: int = 2048, dense: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Symmetric per output channel: w ~ q * scale, q in [-127, 127], computed in float32, the values q * scale given
    in w's dtype (`dense`; else None: an output head's would be 0.47 GB of Qwen2.5-Coder-1.5B's start). A few thousand
    rows at a time: a whole output head's float32 temporaries (Qwen2.5-Coder-0.5B's 151,936 x 896) would cost its
    start fresh pages and passes over memory."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0])
    dequantized = torch.empty_like(w, memory_format=torch.contiguous_format) if dense else None
    for start in range(0, w.shape[0], rows_at_a_time):
        rows = slice(start, start + rows_at_a_time)
        q[rows], scale = quantize_rows(w[rows].float())
        scales[rows] = scale.squeeze(1)
        if dense:
            dequantized[rows] = q[rows].float() * scale
    return q, scales, dequantized


class Int6Levels(NamedTuple):
    q: torch.Tensor  # [out, in] uint8 in [0, 63]
    d: torch.Tensor  # [out, in / 256] float32
    sc: torch.Tensor  # [out, in / 16] int8
    dequantized: torch.Tensor  # [out, in]: d * sc * (q - 32) in float32, as the file's reader computes it (the
    # native op: the weight itself, which it checked equals them)

    def pack(self) -> torch.Tensor:
        return pack_int6(self.q, self.d, self.sc)


class GroupedLevels(NamedTuple):
    q: torch.Tensor  # [out, in] uint8: the integers in [-128, 127] plus 128
    d: torch.Tensor  # [out, in / 32] float32 (fp16 values)
    dequantized: torch.Tensor  # [out, in]: d * (q - 128) in float32 (the native op: the weight itself, as Int6Levels')

    def pack(self) -> torch.Tensor:
        return pack_int8_grouped(self.q, self.d)


def file_levels(weight: torch.Tensor, grid: tuple[torch.Tensor, ...] | None,
                native: bool = False) -> Int6Levels | GroupedLevels | None:
    """The weight's levels on the file's int8 grid (`Checkpoint.int8_grids`: Q6_K's two tensors or Q8_0's and
    Q5_0's one), or None where there is none or it does not give this weight (a weight changed since it was read)."""
    if grid is None:
        return None
    return int6_levels(weight, grid, native) if len(grid) == 2 else grouped_levels(weight, grid, native)


def grouped_levels(weight: torch.Tensor, grid: tuple[torch.Tensor, ...], native: bool = False) -> GroupedLevels | None:
    """The weight's integers on the file's d per 32 inputs, or None where that grid does not give this weight (in
    its own dtype: bf16's rounding moves w / d by at most 128 / 256, which leaves a Q8_0 level of at most 127, and
    any Q5_0 one, the nearest integer)."""
    out_features, in_features = weight.shape
    (d,) = grid
    if not int8_packs(out_features, in_features) or d.shape != (out_features, in_features // INT4_GROUP_SIZE):
        return None
    levels = levels_on(weight, d.float(), -128, 127, native)
    return None if levels is None else GroupedLevels(levels[0], d.float(), levels[1])


def int6_levels(weight: torch.Tensor, grid: tuple[torch.Tensor, ...] | None, native: bool = False
                ) -> Int6Levels | None:
    """The weight's Q6_K levels on the file's grid (d, sc), or None where that grid does not give this weight (in
    its own dtype: bf16's rounding moves w / (d * sc) by at most 32 / 256, so q is still the nearest integer)."""
    out_features, in_features = weight.shape
    if grid is None or not int6_packs(out_features, in_features):
        return None
    d, sc = grid
    if d.shape != (out_features, in_features // INT6_SUPER) or sc.shape != (out_features, in_features // INT6_SUB):
        return None
    scale = d.float().repeat_interleave(INT6_SUPER // INT6_SUB, dim=1) * sc.float()  # [out, in / 16]
    levels = levels_on(weight, scale, -32, 31, native)
    return None if levels is None else Int6Levels(levels[0], d.float(), sc.to(torch.int8), levels[1])
