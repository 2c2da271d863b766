"""Decode attention on a 1-byte KV cache (kernels/paged_attention_quantized.cpp, and the PyTorch path) equals
attention on the cache's dequantized values; the native write stores what kv_quant.quantize_rows does."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import load_cpu_kernels
from llmserve.kv_cache.kv_quant import dequantize_rows, quantize_rows
from llmserve.layers.attention import write_rows
from tests.kernels.test_paged_attention import _paged_case, _torch_path

FORMATS = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _quantized_case(batch, num_heads, num_kv_heads, head_dim, block_size, fmt, q_dtype, seed=0, max_blocks=12):
    q, k, v, table, context = _paged_case(batch, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed,
                                          max_blocks)
    k[..., 3] += 4.0  # an outlier channel in the keys, as real ones have
    return q.to(q_dtype), quantize_rows(k, fmt), quantize_rows(v, fmt), table, context


def _on_dequantized(q, k_rows, v_rows, table, context, scale, window=0):
    """The reference: the float32 kernel on the float32 values the quantized rows stand for."""
    return torch.ops.llmserve.paged_decode_attention(q.float(), dequantize_rows(k_rows, torch.float32),
                                                     dequantize_rows(v_rows, torch.float32), table, context, scale,
                                                     window)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (12, 2, 128), (14, 2, 64), (6, 2, 48)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_native_equals_attention_on_the_dequantized_cache(fmt, num_heads, num_kv_heads, head_dim, block_size):
    # int8 with head_dim a multiple of 32 takes the integer (VNNI) kernel where the CPU has it: its query and
    # probabilities are rounded to ~15 bits, hence the tolerance; the others dequantize to float32
    q, k, v, table, context = _quantized_case(7, num_heads, num_kv_heads, head_dim, block_size, fmt, torch.float32)
    scale = head_dim**-0.5
    out = torch.ops.llmserve.paged_decode_attention(q, k, v, table, context, scale)
    torch.testing.assert_close(out, _on_dequantized(q, k, v, table, context, scale), atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_queries_and_split_long_contexts(fmt):
    # one request: its context is split across threads (flash-decoding parts), and the int8 kernel moves its
    # integer sums to float32 every 256 tokens; a bf16 query is as close as its own rounding allows
    q, k, v, table, context = _quantized_case(1, 9, 3, 64, 16, fmt, torch.bfloat16, seed=3, max_blocks=60)
    assert int(context.max()) > 512
    scale = 64**-0.5
    out = torch.ops.llmserve.paged_decode_attention(q, k, v, table, context, scale).float()
    torch.testing.assert_close(out, _on_dequantized(q, k, v, table, context, scale), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [1, 17, 50])
def test_windowed_native_equals_attention_on_the_dequantized_cache(fmt, block_size, window):
    # sliding-window attention on a 1-byte cache: contexts below and past the window, and the float32 reference
    # itself against the PyTorch path with an explicit banded bias
    q, k, v, table, context = _quantized_case(7, 9, 3, 64, block_size, fmt, torch.float32, seed=window)
    scale = 64**-0.5
    out = torch.ops.llmserve.paged_decode_attention(q, k, v, table, context, scale, window)
    reference = _on_dequantized(q, k, v, table, context, scale, window)
    torch.testing.assert_close(out, reference, atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(reference, _torch_path(q, k, v, table, context, scale, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [100, 333])
def test_windowed_bfloat16_queries_and_split_long_contexts(fmt, window):
    q, k, v, table, context = _quantized_case(1, 9, 3, 64, 16, fmt, torch.bfloat16, seed=3, max_blocks=60)
    assert int(context.max()) > 512
    scale = 64**-0.5
    out = torch.ops.llmserve.paged_decode_attention(q, k, v, table, context, scale, window).float()
    torch.testing.assert_close(out, _on_dequantized(q, k, v, table, context, scale, window), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_path_equals_attention_on_the_dequantized_cache(fmt):
    q, k, v, table, context = _quantized_case(5, 9, 3, 64, 16, fmt, torch.float32, seed=2)
    scale = 64**-0.5
    torch.testing.assert_close(_torch_path(q, k, v, table, context, scale),
                               _on_dequantized(q, k, v, table, context, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_stores_the_bytes_the_torch_path_stores(fmt, dtype):
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(6, 3, 64, generator=gen) * 3).to(dtype), torch.randn(6, 3, 64, generator=gen).to(dtype)
    k[0, 0] = 0  # a zero row: scale 0
    cache = torch.zeros(10, 3, 4, 64 + 4, dtype=fmt)
    slots = torch.randperm(10 * 3 * 4, generator=gen)[:18]
    k_ours, v_ours, k_ref, v_ref = (cache.clone() for _ in range(4))
    torch.ops.llmserve.write_kv(k, v, k_ours, v_ours, slots)
    write_rows(k_ref, slots, k)
    write_rows(v_ref, slots, v)
    assert torch.equal(k_ours.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_ours.view(torch.uint8), v_ref.view(torch.uint8))


def test_a_quantized_cache_of_the_wrong_width_is_refused():
    cache = torch.zeros(4, 1, 2, 8, dtype=torch.int8)  # room for head_dim 4, not 8
    q = torch.ones(1, 2, 8)
    with pytest.raises(RuntimeError, match="head_dim must match"):
        torch.ops.llmserve.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                                  torch.ones(1, dtype=torch.int32), 1.0)
