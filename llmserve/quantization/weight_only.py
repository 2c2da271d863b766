"""Weight-only quantized linear layers (int8 per output channel, int4 in groups of 32).

Why: a decode step of a few requests is bound by the bytes of weight it reads, and int4/int8 read
4x/2x fewer than bf16 (PyTorch's CPU kernels `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm`
dequantize on the fly). But those kernels are slower than a bf16 GEMM once a step carries more than a
handful of tokens (measured here, 30 layers of SmolLM2's linears: 1 token 2.6 ms int4 / 4.2 ms int8 /
10.3 ms bf16; 32 tokens 21.9 / 24.7 / 16.9 ms; 256 tokens 181 / 187 / 70 ms). So each layer keeps both:
the quantized weight for small steps and its exact dequantization, in the model dtype, for large ones.
Both paths compute with the same quantized values; they differ only in rounding order.

int4 follows GGUF's Q4_1 scheme (per group of 32 inputs: scale = (max - min) / 15, zero = min), so
the embedded Q4_1 model's weights, already dequantized by the loader, are re-quantized to the values
they were shipped as.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.config import QUANTIZATION_METHODS as METHODS
from llmserve.layers.linear import dense_linear
from llmserve.quantization.int8_activations import int8_linear, pack_int8_weight, quantize_rows, smoothing_scales

INT4_GROUP_SIZE = 32
# Steps with at most this many tokens use the quantized kernel (the crossover measured above).
QUANTIZED_MAX_TOKENS = {"int8": 8, "int4": 16}


class WeightOnlyLinear(nn.Module):
    """A bias-free linear layer `y = x W^T` over a quantized W."""

    def __init__(self, weight: torch.Tensor, method: str) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"quantization must be one of {list(METHODS)}, got {method!r}")
        self.method = method
        self.max_quantized_tokens = QUANTIZED_MAX_TOKENS[method]
        dtype = weight.dtype
        with torch.no_grad():
            if method == "int8":
                qweight, scales, dequantized = _quantize_int8(weight.float())
            else:
                qweight, scales, dequantized = _quantize_int4(weight.float())
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.to(dtype))
        # the large-step path: the quantized values themselves, in the model dtype
        self.register_buffer("weight", dequantized.to(dtype))
        self.packed: torch.Tensor | None = None  # its oneDNN-packed copy, once `prepack_linears` made one
        # or, once `use_int8_activations` ran, the large-step path is int8 x int8 (see int8_activations.py)
        self.register_buffer("int8_weight", None)
        self.register_buffer("int8_scales", None)
        self.register_buffer("int8_zeros", None)
        self.register_buffer("smooth_inv", None)
        self.int8_packed: torch.Tensor | None = None

    def use_int8_activations(self, act_absmax: torch.Tensor) -> None:
        """Large steps from now on: SmoothQuant-smoothed int8 weights x per-token int8 activations, given
        the largest |input| seen per channel. The dense weight and its packed copy are released."""
        with torch.no_grad():
            smooth = smoothing_scales(act_absmax, self.weight)
            qweight, scales, _ = _quantize_int8(self.weight.float() * smooth)
        self.int8_weight, self.int8_scales, self.smooth_inv = qweight, scales.float(), 1 / smooth
        self.int8_zeros = torch.zeros(len(scales), dtype=torch.int64)
        self.int8_packed = pack_int8_weight(qweight)
        self.weight, self.packed = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_quantized_tokens:
            if self.int8_weight is not None:
                return int8_linear(x, self.smooth_inv, self.int8_weight, self.int8_scales, self.int8_zeros,
                                   self.int8_packed)
            return dense_linear(self, x)
        if self.method == "int8":
            return torch._weight_int8pack_mm(x, self.qweight, self.scales)
        return torch._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP_SIZE, self.scales)


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: w ~ q * scale, q in [-127, 127]."""
    q, scales = quantize_rows(w)
    return q, scales.squeeze(1), q.float() * scales


def _quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per group of 32 inputs (Q4_1): w ~ q * scale + min, q in [0, 15].

    The kernel's form is (q - 8) * scale + zero, so zero = min + 8 * scale; scales and zeros are
    packed as [in / 32, out, 2]."""
    out_features, in_features = w.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(f"int4 needs input features divisible by {INT4_GROUP_SIZE}, got {in_features}")
    groups = w.view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
    dequantized = (q * scale[..., None] + lo[..., None]).view(out_features, in_features)
    zero = lo + 8 * scale
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(out_features, in_features), 1)
    return packed, scales_and_zeros, dequantized


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace every bias-free `nn.Linear` of the decoder layers by a `WeightOnlyLinear`, and give the
    output head int8 weights (a tied embedding stays as it is: a lookup reads one row)."""
    for module in list(model.layers.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None:
                setattr(module, child_name, WeightOnlyLinear(child.weight, method))
    model.lm_head = WeightOnlyLinear(model.lm_head.weight, "int8")
    return model
