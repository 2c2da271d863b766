"""GGML's block formats decoded with torch ops, a few million values a pass, on every core; where the native kernels
are built, `kernels/ggml_decode.cpp` decodes the same formats to the same values in one pass a block, faster
(docs/performance.md, "Start-up").

Why not the `gguf` package's decoder: it is numpy, one thread, sixteen rows a call, a large share of a larger
model's start (docs/performance.md, "Start-up"). Each format here does the
package's float32 arithmetic in the package's order, into one output tensor (a fresh tensor per step would pay its
page faults again), so its values are the package's bit for bit (the tests compare every format on random blocks
and on the real files); a format not listed here is still decoded by the package.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from llmserve.kernels import native_op

# values decoded per pass: the temporaries (a few bytes a value) stay in the cache whatever the tensor's size (a 1.5B
# model's embedding is 233 M values); larger passes decode the Qwen files more slowly
# (docs/performance.md, "Start-up")
_CHUNK_VALUES = 1 << 18
_NIBBLE_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8)


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, run: int) -> torch.Tensor:
    """[n, bytes] -> [n, 2 * bytes / run, run]: each run of `run` bytes gives its low nibbles, then its high ones."""
    n = packed.shape[0]
    return ((packed.reshape(n, -1, 1, run) >> _NIBBLE_SHIFTS.view(1, 1, 2, 1)) & 0x0F).reshape(n, -1, run)


def _high_bits(packed: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of 32 one-bit flags (little-endian) -> [n, 32] uint8, bit i at i."""
    words = packed.contiguous().view(torch.int32)  # [n, 1]: an arithmetic shift, but `& 1` keeps only bit i
    return ((words >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)


def _scale_min_k(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: twelve bytes of eight 6-bit scales and eight 6-bit minima (`gguf.quants.Q4_K.get_scale_min`)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: each group of 32's scale and minimum, [n, 8, 1] (d * sc, dmin * m)."""
    sc, mn = _scale_min_k(b[:, 4:16])
    return (_fp16(b, 0) * sc).unsqueeze(-1), (_fp16(b, 2) * mn).unsqueeze(-1)


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 2:], 16).reshape(len(b), -1)
    torch.mul(q.to(torch.int8) - 8, _fp16(b, 0), out=out)


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 4:], 16).reshape(len(b), -1)
    torch.mul(q, _fp16(b, 0), out=out).add_(_fp16(b, 2))


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 6:], 16).reshape(len(b), -1) | (_high_bits(b[:, 2:6]) << 4)
    torch.mul(q.to(torch.int8) - 16, _fp16(b, 0), out=out)


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 8:], 16).reshape(len(b), -1) | (_high_bits(b[:, 4:8]) << 4)
    torch.mul(q, _fp16(b, 0), out=out).add_(_fp16(b, 2))


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(b[:, 2:].contiguous().view(torch.int8), _fp16(b, 0), out=out)


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    d, dm = _k_scales(b)
    torch.mul(_nibbles(b[:, 16:], 32), d, out=out.view(len(b), 8, 32)).sub_(dm)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    d, dm = _k_scales(b)
    high = ((b[:, 16:48].reshape(-1, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1)
    q = _nibbles(b[:, 48:], 32) | (high.reshape(len(b), 8, 32) << 4)
    torch.mul(q, d, out=out.view(len(b), 8, 32)).sub_(dm)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = len(b)
    d = (_fp16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    torch.mul(q, d, out=out.view(n, 16, 16))


_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0, GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0, GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k, GGMLQuantizationType.Q6_K: _q6_k,
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, native: bool | None = None) -> torch.Tensor:
    """A quantized tensor's bytes (uint8 rows of its blocks, as `read_tensors` gives them, read-only is fine) ->
    its float32 values, [rows, row values]. `native`: decode with `kernels/ggml_decode.cpp` (one pass a block;
    the same values), default where the kernels are built; else with the torch ops below."""
    rows = data.shape[0] if data.ndim > 1 else 1
    decode = _DECODERS.get(qtype)
    if decode is None:
        return torch.from_numpy(gguf_dequantize(data, qtype).astype(np.float32, copy=False)).reshape(rows, -1)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    with warnings.catch_warnings():  # a read-only map of the file: nothing here writes to it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        blocks = torch.from_numpy(np.asarray(data).view(np.uint8)).reshape(-1, type_size)
    if (op := native_op("ggml_dequantize", blocks, native)) is not None:
        return op(blocks, int(qtype)).reshape(rows, -1)
    out = torch.empty(len(blocks), block_size)
    step = max(1, _CHUNK_VALUES // block_size)
    for start in range(0, len(blocks), step):
        decode(blocks[start:start + step], out[start:start + step])
    return out.reshape(rows, -1)
