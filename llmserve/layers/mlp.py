"""The gated MLP every family uses (down(act(gate(x)) * up(x))), gate and up fused into one matmul at load time.

Linears are created without drawing initial values (`uninitialized_linear`): a checkpoint fills every parameter,
and the draw costs seconds of a start (docs/performance.md, "Start-up").
"""

from __future__ import annotations

import torch
from torch import nn


def uninitialized_linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """A linear whose parameters are empty CPU tensors: built on the meta device (no draw), then given storage.
    Not `torch.nn.utils.skip_init`: its `to_empty` goes through torch's reference ops, which import the symbolic
    shapes (and, for an embedding, torch._dynamo): a cost to a start that compiles nothing."""
    linear = nn.Linear(in_features, out_features, bias, device="meta")
    for name, param in list(linear.named_parameters(recurse=False)):
        setattr(linear, name, nn.Parameter(torch.empty(param.shape)))
    return linear


# the gate's activation, by `ModelConfig.activation`
ACTIVATIONS = {"silu": nn.functional.silu, "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}
# its native op over the fused gate/up rows (kernels/fused_elementwise.cpp), by name: the ops exist once loaded
NATIVE_GATES = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}


class GatedMLP(nn.Module):
    """`native` (the build plan's): the gate on kernels/fused_elementwise.cpp in eager steps."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 native: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.tp = None  # tensor parallel (distributed/tensor_parallel.py): down_proj's partial sums are all-reduced
        self.gate_up_proj = uninitialized_linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = uninitialized_linear(intermediate_size, hidden_size, bias=False)
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.native = native

    def source_rows(self, linear: str) -> list[int]:
        """The rows each checkpoint tensor gives one of these linears, in order (gate, up: the fused gate/up)."""
        return [self.intermediate_size] * 2 if linear == "gate_up_proj" else [self.down_proj.out_features]

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj's input: act(gate) * up, [T, intermediate]."""
        gate_up = self.gate_up_proj(x)
        if self.native and not torch.compiler.is_compiling():
            return getattr(torch.ops.llmserve, NATIVE_GATES[self.activation])(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.gated(x))
        return out if self.tp is None else self.tp.all_reduce(out)
