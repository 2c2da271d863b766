"""The FP8 (e4m3) weight layout `fp8_gemv.cpp` reads, and the op's shape for torch.compile.

Why a layout of its own: the kernel widens each input's 16 rows at once (one float32 lane a row), so a row block's
bytes are stored input by input, each block of 128 inputs after its 16 rows' scales. Packing is reshuffling: the
packed weight holds exactly the e4m3 bytes and scales it was given (the scales times 2^8, exact, see the C++ file).
"""

from __future__ import annotations

import torch

FP8_ROWS = 16  # output rows per row block: out_features must be a multiple of it
FP8_BLOCK = 128  # inputs per scale (the last block of a row shorter where in_features is not a multiple of it)


def fp8_packs(out_features: int, in_features: int) -> bool:
    return out_features % FP8_ROWS == 0 and in_features > 0


def fp8_blocks(in_features: int) -> int:
    """Scales per row: one per block of 128 inputs."""
    return -(-in_features // FP8_BLOCK)


def pack_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [out, in] float8_e4m3fn, scales [out, ceil(in / 128)] float32 (w = q * scale per block of 128 inputs).
    Returns the flat uint8 layout `llmserve::fp8_gemv` reads: per row block of 16 rows and block of 128 inputs, the 16
    scales times 2^8 as float32, then per input the 16 rows' bytes."""
    out_features, in_features = q.shape
    if not fp8_packs(out_features, in_features):
        raise ValueError(f"fp8 packing needs out_features % {FP8_ROWS} == 0, got {out_features}")
    blocks = fp8_blocks(in_features)
    if scales.shape != (out_features, blocks):
        raise ValueError(f"fp8 scales must be [{out_features}, {blocks}], got {list(scales.shape)}")
    row_blocks = out_features // FP8_ROWS
    body = q.view(torch.uint8).view(row_blocks, FP8_ROWS, in_features).transpose(1, 2)  # [block, input, row]
    header = (scales.float() * 256).view(row_blocks, FP8_ROWS, blocks).transpose(1, 2).contiguous()
    header = header.view(torch.uint8).view(row_blocks, blocks, FP8_ROWS * 4)
    parts = []
    for b in range(blocks):
        parts += [header[:, b], body[:, b * FP8_BLOCK:(b + 1) * FP8_BLOCK].reshape(row_blocks, -1)]
    return torch.cat(parts, dim=1).contiguous().view(-1)


def register_fakes() -> None:
    """The op's output shape, so that torch.compile keeps it inside its graphs."""

    @torch.library.register_fake("llmserve::fp8_gemv")
    def _(x, packed, n, activation_parts=2):
        return x.new_empty(x.shape[0], n)
