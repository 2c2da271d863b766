"""The fused activation quantization equals, bit for bit, the PyTorch ops it replaces in eager steps."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import load_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _pytorch_form(x, smooth_inv):  # quantization/int8_activations.py's decomposed form
    xs = x.float() * smooth_inv
    row_scales = xs.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return (torch.round(xs / row_scales) + 128).clamp(1, 255).to(torch.uint8), row_scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,features", [(1, 576), (64, 576), (33, 1536), (5, 7)])
def test_equals_the_pytorch_ops_bit_for_bit(dtype, rows, features):
    gen = torch.Generator().manual_seed(rows * features)
    x = (torch.randn(rows, features, generator=gen) * 3).to(dtype)
    x[0, : features // 2] = 0  # zeros and a row of exact multiples of its scale (round-half ties)
    if rows > 2:
        x[1] = 0
        x[2] = (torch.arange(features) % 255 - 127).to(dtype) / 2
    smooth_inv = torch.rand(features, generator=gen) + 0.5
    q, scales = torch.ops.llmserve.quantize_activations_u8(x, smooth_inv)
    q_ref, scales_ref = _pytorch_form(x, smooth_inv)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q, q_ref)


def test_bad_inputs_raise():
    with pytest.raises(RuntimeError, match="one smoothing factor per feature"):
        torch.ops.llmserve.quantize_activations_u8(torch.randn(2, 8), torch.ones(7))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.llmserve.quantize_activations_u8(torch.randn(2, 8).half(), torch.ones(8))
