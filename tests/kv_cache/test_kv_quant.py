"""1-byte KV rows (kv_cache/kv_quant.py): the error bound of each format, zeros, the layout."""

from __future__ import annotations

import pytest
import torch

from llmserve.kv_cache.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows


def _rows(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 64, generator=gen) * torch.logspace(-3, 3, 64).view(-1, 1, 1)  # rows of every size
    x[:, 0, 5] *= 40  # an outlier channel, as keys have
    return x


def test_int8_error_is_at_most_half_a_step_of_the_row():
    x = _rows()
    rows = quantize_rows(x, torch.int8)
    assert rows.dtype == torch.int8 and rows.shape == (64, 4, 64 + SCALE_BYTES)
    step = x.abs().amax(-1, keepdim=True) / 127
    err = (dequantize_rows(rows, torch.float32) - x).abs()
    assert (err <= step * 0.5 * (1 + 1e-5)).all()
    assert err.max() > 0  # it is quantized


def test_fp8_error_is_within_e4m3_rounding():
    x = _rows(1)
    rows = quantize_rows(x, torch.float8_e4m3fn)
    assert rows.dtype == torch.float8_e4m3fn
    scale = x.abs().amax(-1, keepdim=True) / 448
    err = (dequantize_rows(rows, torch.float32) - x).abs()
    # 3 mantissa bits: half an ulp is 1/16 of the value; below e4m3's smallest normal (2^-6) the ulp is 2^-9
    assert (err <= torch.maximum(x.abs() / 16, scale * 2.0**-10) * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_zero_row_stays_zero(dtype):
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    out = dequantize_rows(quantize_rows(x, dtype), torch.bfloat16)
    assert torch.equal(out, x)


def test_the_scale_sits_after_the_values():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0]])
    rows = quantize_rows(x, torch.int8)
    assert rows[0, :4].tolist() == [1, -2, 0, 127]  # 0.5 rounds half to even
    assert rows.view(torch.uint8)[0, 4:].view(torch.float32).item() == pytest.approx(1.0)
