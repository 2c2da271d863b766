"""RMSNorm, computed in float32 as the reference Llama implementation does (bit-for-bit order).

`native` (chosen by the build plan; eager steps on CPU, see kernels/fused_elementwise.cpp): one op
instead of five, and `add_forward` folds the residual add in; rounded once at the end instead of after
each op. Compiled code keeps PyTorch's ops, which Inductor fuses itself.

`unit_offset` (Gemma): the weight is stored as w and scales by 1 + w, computed in float32 and rounded once,
as Gemma's reference does (Llama's reference rounds the normed value first, then scales); the native op adds the
one in float32 as it reads the weight.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, native: bool = False, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.native = native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, features], or [tokens, heads, head_dim] (a query/key norm: each head normed on its own)."""
        if self.native and not torch.compiler.is_compiling():
            return torch.ops.llmserve.rms_norm(x, self.weight, self.eps, self.unit_offset)
        if self.unit_offset:
            normed = nn.functional.rms_norm(x.float(), self.weight.shape, eps=self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # x * rsqrt(mean(x^2) + eps) in float32 (one call instead of five), rounded back, then the weight
        normed = nn.functional.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    @torch.no_grad()
    def scale_output_(self, factor: torch.Tensor) -> None:
        """Multiply what the norm outputs by `factor` per channel, folded into its weight (a calibration's scales:
        AWQ, key smoothing); with Gemma's unit offset the scale 1 + w is what is multiplied."""
        offset = 1.0 if self.unit_offset else 0.0
        self.weight.copy_((self.weight.float() + offset) * factor.float() - offset)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it): a residual add and the norm that reads its result."""
        if self.native and not torch.compiler.is_compiling():
            return torch.ops.llmserve.add_rms_norm(x, delta, self.weight, self.eps, self.unit_offset)
        x = x + delta
        return x, self.forward(x)
