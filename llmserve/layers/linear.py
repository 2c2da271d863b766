"""Dense linear layers with their weight prepacked once for oneDNN (bf16 and float32 on CPU).

Why: a bf16 `F.linear` on CPU reorders the weight into oneDNN's blocked layout on every call. At decode
sizes that reorder is a large part of the matmul, and prepacking pays at every step size
(docs/performance.md, "Large steps: int8 activations and dense products"). The packed bf16 product is
bit-identical to `F.linear`. A compiled graph does not need this: Inductor's freezing packs its weights itself (see
engine/decode_graph.py), so while compiling the layers trace the plain `F.linear`.

In float32 `F.linear` is MKL's sgemm, which on AMD hosts runs far behind oneDNN's packed product at decode sizes
(docs/performance.md, "Large steps: int8 activations and dense products"). So float32 weights are
packed too, dense ones and a quantized layer's large-step copy alike. The rounding is oneDNN's, not MKL's (a few
1e-6 apart), as a batched step's MKL product was never the one-token product transformers' greedy reference
computes either: greedy output is held to transformers by the tests, whatever the product.
"""

from __future__ import annotations

import torch
from torch import nn


def packs(weight: torch.Tensor) -> bool:
    """Whether the weight has a packed form here: float32, and bf16 on a CPU that oneDNN runs bf16 on."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a [out, in] weight, or None where the plain matmul is the one to use."""
    if not packs(weight):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)  # 32: the batch size to tune for


def dense_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, layer.weight, layer.bias)`, through `layer.packed` when it has one and runs eagerly."""
    bias = getattr(layer, "bias", None)
    # compiling: the tracer must not see the opaque packed tensor (and freezing packs on its own)
    if torch.compiler.is_compiling() or layer.packed is None:
        return nn.functional.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An `nn.Linear` (its weight and bias shared, not copied) that multiplies through a packed weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = prepack_weight(linear.weight)  # an attribute, not a buffer: no state_dict entry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(self, x)


def prepack_linears(model: nn.Module, release_plain: bool = False) -> int:
    """Pack the weight of every dense linear that packs: an `nn.Linear` becomes a `PackedLinear`, a layer
    with a `packed` slot (the quantized layers' large-step path, where it has a dense weight) gets it filled.
    `release_plain`: drop each plain copy as soon as its packed one exists (see `release_plain_weights`), so the
    peak holds one layer's weight twice, not the model's. Returns how many were packed."""
    packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and packs(child.weight):
                child = PackedLinear(child)
                setattr(module, name, child)
                packed += 1
            elif getattr(child, "packed", False) is None and child.weight is not None:
                child.packed = prepack_weight(child.weight)
                packed += child.packed is not None
            else:
                continue
            if release_plain:
                release_plain_weights(child)
    return packed


def release_plain_weights(model: nn.Module) -> int:
    """Drop the plain copy of every weight that has a packed one: eager steps read only the packed copy,
    so the plain one is the dense weights' bytes a second time (3.1 GB for a 1.5B model). Call it only
    where nothing reads the plain copy again: no compiled graph (it traces `F.linear`) and no int8-activation
    calibration (it smooths the plain weight). A weight shared with another module (a tied output head)
    stays where that module holds it. Returns how many were dropped."""
    dropped = 0
    for module in model.modules():
        if getattr(module, "packed", None) is not None and getattr(module, "weight", None) is not None:
            module.weight = None
            dropped += 1
    return dropped
