"""A KV cache of 1-byte values (int8 or fp8 e4m3): twice the tokens in the same memory, half the bytes that
decode attention reads.

Each cache row (one token of one KV head) holds its `head_dim` values and, right after them, their float32
scale: x ~= value * scale.

    [num_blocks, num_kv_heads, block_size, head_dim + 4]      (1-byte elements)
                                           └─ v_0 … v_{D-1} | scale (4 bytes, float32)

Why one scale per token and KV head: K and V are written a token at a time (decodes, chunks, speculative
tokens later rolled back), so a row's scale is fixed when it is written and never revisited — no block
needs re-quantizing as it fills, a rolled-back or recomputed token leaves nothing stale behind, and prefix
caching, preemption and speculation see blocks exactly as before. KIVI's per-channel keys would need the
whole block first. The scale sits in the row so the cache stays one tensor per layer for K and one for V:
every path that passes caches around (the model, the compiled graph, the fused decode stack) is
unchanged; only the code that writes or reads rows knows the format. In the attention kernels a
token's scale multiplies its score (K) and its probability (V), so dequantizing costs no extra pass.
Symmetric scales (amax / 127 for int8, amax / 448 for e4m3): a row of zeros gets scale 0.

The native kernels (kernels/paged_attention_quantized.cpp) write and read the same layout, rounding as these
functions do (times the scale's reciprocal, round half to even), so both paths store the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 after each row's values

# config name -> stored dtype
QUANTIZED_KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                                               "fp8_e4m3": torch.float8_e4m3fn}
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in _LARGEST


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements in one cache row."""
    return head_dim + SCALE_BYTES if is_quantized(cache_dtype) else head_dim


def quantize_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim] (any float dtype) -> rows [..., head_dim + 4] of `cache_dtype`."""
    largest = _LARGEST[cache_dtype]
    xf = x.float()
    # multiplications by reciprocals, as the native write computes them (so both store the same bytes)
    scale = xf.abs().amax(dim=-1, keepdim=True) * (1 / largest)
    v = xf * torch.where(scale > 0, scale, torch.ones_like(scale)).reciprocal()
    v = v.round() if cache_dtype == torch.int8 else v
    values = v.clamp_(-largest, largest).to(cache_dtype)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(cache_dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., head_dim + 4] -> [..., head_dim] of `dtype` (value * scale, computed in float32)."""
    raw = rows.view(torch.uint8)
    values = raw[..., :-SCALE_BYTES].view(rows.dtype).float()
    return (values * raw[..., -SCALE_BYTES:].view(torch.float32)).to(dtype)
