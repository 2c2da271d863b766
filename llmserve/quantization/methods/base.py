"""What a weight format implements: how a weight becomes its kernel's layout, and the small-step product.

Why this much and no more: everything else a quantized layer does is the same for every format (a bias added after
the product, the large-step product over the exact dequantized values or int8 x int8, oneDNN packing, the one-call
decode stack reading the packed weight and its scales), so it lives once in `weight_only.WeightOnlyLinear`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from llmserve.quantization.methods import LinearMethodSpec

# A small-step product: (the layer, its input rows) -> its output rows, without the bias.
SmallStep = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


class PreparedWeight(NamedTuple):
    """A weight as a layer of this format holds it."""

    qweight: torch.Tensor | None  # the small-step kernel's weight (None: every step takes the large-step product)
    scales: torch.Tensor | None  # its row scales where the kernel reads any
    # the exact values the products compute with, for the large-step product (None where not asked for and the
    # format saves making them)
    dequantized: torch.Tensor | None
    layout: str  # how the kernel holds them: for logs and tests ("groups of 32", "super-blocks", "per row",
    # "six-bit", "grouped")


class LinearMethod(ABC):
    """One registered weight format (`methods.LINEAR_METHODS`)."""

    def __init__(self, spec: LinearMethodSpec) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @abstractmethod
    def native_packs(self, out_features: int, in_features: int) -> bool:
        """Whether the native small-step kernel takes a weight of this shape."""

    @abstractmethod
    def prepare(self, weight: torch.Tensor, grid: tuple[torch.Tensor, ...] | None, native: bool,
                dense: bool = True) -> PreparedWeight:
        """The weight in this format: on the file's own `grid` where it has one that gives this weight's values, else
        fitted to it. `native`: for the native kernel's layout (the caller loaded the kernels, and `native_packs`).
        `dense`: the caller keeps the dequantized values (else a format may leave them out)."""

    @abstractmethod
    def small_step(self, native: bool) -> SmallStep:
        """The small-step product: the native kernel's, or PyTorch's."""


def native_levels(weight: torch.Tensor, native: bool) -> bool:
    """Whether `grid_levels.cpp`'s ops take this weight (else PyTorch's ops compute the same values)."""
    return native and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)


def levels_on(weight: torch.Tensor, scale: torch.Tensor, lowest: int, highest: int, native: bool
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The integers q in [lowest, highest] with weight = q * scale (`scale` [out, runs], one per run of in / runs
    inputs), as uint8 q - lowest, and those values; None where they do not give the weight. `native`: the kernels
    are loaded, and `grid_levels.cpp`'s `signed_levels` finds the integers and checks them in one pass (the values
    are then the weight's own), else PyTorch's ops (the values in float32): the same integers and values."""
    out_features, in_features = weight.shape
    w = weight.detach()
    if native_levels(weight, native):
        dense = w.contiguous()
        q, exact = torch.ops.llmserve.signed_levels(dense, scale.contiguous(), lowest, highest)
        if not exact:
            return None
        # the layer keeps these values: not as a view into a larger tensor (a run of a fused weight's rows), which
        # would keep all of it alive
        return q, dense if dense.untyped_storage().nbytes() == dense.nbytes else dense.clone()
    scale = scale.unsqueeze(2)
    # in place after the first op (each fresh [out, in] tensor pays its page faults: start-up time)
    q = torch.div(w.view(out_features, scale.shape[1], -1), torch.where(scale != 0, scale, 1)).round_()
    q = q.clamp_(lowest, highest)
    dequantized = torch.mul(q, scale).view(out_features, in_features)
    if not torch.equal(dequantized.to(weight.dtype), w):  # float32: `to` is no copy
        return None
    return q.sub_(lowest).to(torch.uint8).view(out_features, in_features), dequantized
