"""Asymmetric int4 in groups of any size (AutoAWQ's zero-point form), and its exact form on our kernels.

Why: AWQ checkpoints (and the AWQ kernels of vLLM and transformers) keep, per group of g inputs (g = 128
usually), one fp16 scale and an integer zero point: w = (q - z) * s, q and z in [0, 15]. Our int4 kernels
(`kernels/quantized_gemv.cpp`) hold GGUF Q4_1's form per group of 32 inputs, w = q * scale + min, fp16
scale and min. A group of g = 32k inputs is k groups of 32 with the same scale and min = -z * s, so any
such g runs on our kernels unchanged (`grid32`): no new packing, and the same bytes per weight in memory
(g = 128 only makes the file smaller). The one rounding is min's to fp16 (|min| <= 15 s, so at most
15 * 2^-11 of a step, as with Q4_K's minimums); the values our layers hold are the same for a model
quantized in memory and for the file it wrote, so both compute the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

KERNEL_GROUP = 32  # our int4 kernels' group: a group size must be a multiple of it
MAX_Q = 15


@dataclass(frozen=True)
class Int4Groups:
    """One weight [out, in] on an int4 grid of `group_size` inputs per scale and zero point."""

    q: torch.Tensor  # [out, in] int32 in [0, 15]
    scales: torch.Tensor  # [out, in / group_size] float32 holding fp16 values
    zeros: torch.Tensor  # [out, in / group_size] int32 in [0, 15]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """(q - z) * s, float32 [out, in]: the values AWQ's kernels compute with."""
        zeros = self.zeros.repeat_interleave(self.group_size, dim=-1)
        return (self.q - zeros).float() * self.scales.repeat_interleave(self.group_size, dim=-1)

    def grid32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, min) per group of 32 inputs, float32 [out, in / 32]: the `int4_grids` form our
        `WeightOnlyLinear` takes (each group of g repeated g / 32 times; min = -z * s)."""
        repeat = self.group_size // KERNEL_GROUP
        scale = self.scales.repeat_interleave(repeat, dim=-1)
        return scale, -self.zeros.repeat_interleave(repeat, dim=-1).float() * scale

    def rows(self, start: int, end: int) -> Int4Groups:
        """The groups of output rows [start, end) (a fused q/k/v or gate/up weight's parts)."""
        return Int4Groups(self.q[start:end], self.scales[start:end], self.zeros[start:end], self.group_size)


def check_group_size(group_size: int, in_features: int | None = None) -> None:
    """ValueError unless `group_size` is a positive multiple of 32 (dividing `in_features`, if given)."""
    if group_size < KERNEL_GROUP or group_size % KERNEL_GROUP:
        raise ValueError(f"int4 group size must be a multiple of {KERNEL_GROUP} (32, 64, 128, ...), got {group_size}")
    if in_features is not None and in_features % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide the {in_features} input features")


def stored_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int, layout: str,
                  stored: str) -> Int4Groups:
    """A checkpoint's groups of one linear as its reader unpacked them: q [out, in] and zeros [out, in / group_size]
    integers, scales [in / group_size, out] as the file stores them (fp16). ValueError, naming the `layout` and the
    `stored` tensors' shapes, where they disagree."""
    out_features, in_features = q.shape
    check_group_size(group_size, in_features)
    n_groups = in_features // group_size
    if scales.shape != (n_groups, out_features) or zeros.shape != (out_features, n_groups):
        raise ValueError(f"{layout} tensors disagree: {stored} for group size {group_size}")
    return Int4Groups(q, scales.float().t().contiguous(), zeros, group_size)


def read_packed_linears(tensors: dict[str, torch.Tensor], layout: str, companions: tuple[str, ...],
                        unpack: Callable[[str], Int4Groups]) -> tuple[dict[str, torch.Tensor], dict[str, Int4Groups]]:
    """A packed-int4 file's tensors (AWQ's, GPTQ's: `X.qweight` beside `X.qzeros`, `X.scales` and the layout's other
    `companions`): each linear's dense weight `X.weight` and its groups (`unpack(X)`), the other tensors as they are.
    ValueError for a qweight without its qzeros and scales."""
    weights, groups = {}, {}
    for name, tensor in tensors.items():
        if name.endswith((".qzeros", ".scales", *companions)):
            continue
        if not name.endswith(".qweight"):
            weights[name] = tensor
            continue
        prefix = name.removesuffix(".qweight")
        if f"{prefix}.qzeros" not in tensors or f"{prefix}.scales" not in tensors:
            raise ValueError(f"{layout} checkpoint has {name} without its qzeros and scales")
        g = unpack(prefix)
        weights[f"{prefix}.weight"], groups[f"{prefix}.weight"] = g.dequantize(), g
    return weights, groups


def fit_groups(w: torch.Tensor, group_size: int) -> Int4Groups:
    """Round to nearest on the group's range (AutoAWQ's `pseudo_quantize_tensor` with zero points):
    s = (max - min) / 15 as an fp16 value, z = -round(min / s), q = round(w / s) + z, both in [0, 15]."""
    out_features, in_features = w.shape
    check_group_size(group_size, in_features)
    groups = w.float().view(out_features, in_features // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo).clamp(min=1e-5) / MAX_Q).half().float()
    zeros = (-torch.round(lo / scales)).clamp(0, MAX_Q)
    q = (torch.round(groups / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, MAX_Q)
    return Int4Groups(q.view(out_features, in_features).to(torch.int32), scales, zeros.to(torch.int32), group_size)


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w rounded to its int4 groups and back, float32: what the search measures a candidate with."""
    return fit_groups(w, group_size).dequantize()


def concat_rows(parts: list[Int4Groups]) -> Int4Groups:
    """Several weights' groups stacked by rows (the same group size)."""
    return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.zeros for p in parts]), parts[0].group_size)
