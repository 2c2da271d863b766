"""Weight layouts for the native quantized products (`quantized_gemv.cpp`), and the ops' shapes for
torch.compile.

The kernels read weights in the order their loops consume them (see the C++ file's header for the byte
layout), so each linear layer keeps a packed copy made once at load. Packing is plain tensor reshuffling:
the packed weight holds exactly the quantized values it was given.
"""

from __future__ import annotations

import torch

ROWS = 16  # output rows per row block: out_features must be a multiple of it
INT4_GROUP = 32  # inputs per scale and minimum


def int4_packs(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % INT4_GROUP == 0


def int8_packs(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % INT4_GROUP == 0


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers in [0, 15]; scales, mins [out, in / 32] (w = q * scale + min, as fp16).
    Returns the flat uint8 layout `llmserve::int4_gemv` reads."""
    out_features, in_features = q.shape
    if not int4_packs(out_features, in_features):
        raise ValueError(f"int4 packing needs out_features % {ROWS} == 0 and in_features % {INT4_GROUP} == 0")
    blocks, groups = out_features // ROWS, in_features // INT4_GROUP
    # byte (vector c, row r, slot s) of a group = q[r, 8c + s] | q[r, 8c + 4 + s] << 4
    q = q.to(torch.uint8).view(blocks, ROWS, groups, 4, 2, 4)  # [block, row, group, c, nibble, s]
    nibbles = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256)

    def per_block(values: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [block, group, 16 rows] fp16 bytes
        rows = values.to(torch.float16).view(blocks, ROWS, groups).transpose(1, 2).contiguous()
        return rows.view(torch.uint8).view(blocks, groups, 2 * ROWS)

    return torch.cat([nibbles, per_block(scales), per_block(mins)], dim=2).contiguous().view(-1)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] int8. Returns the flat uint8 layout `llmserve::int8_gemv` reads: per block of 16 rows and
    group of 32 inputs, 8 vectors of 64 bytes, vector c holding inputs 4c..4c+3 of each row in turn, as
    q + 128 (the kernel multiplies unsigned weight bytes by signed activation bytes)."""
    out_features, in_features = q.shape
    if not int8_packs(out_features, in_features):
        raise ValueError(f"int8 packing needs out_features % {ROWS} == 0 and in_features % {INT4_GROUP} == 0")
    unsigned = (q.to(torch.int16) + 128).to(torch.uint8)
    # [block, row, group, c, s] -> [block, group, c, row, s]
    blocks = unsigned.view(out_features // ROWS, ROWS, in_features // INT4_GROUP, 8, 4)
    return blocks.permute(0, 2, 3, 1, 4).contiguous().view(-1)


def register_fakes() -> None:
    """Output shapes of the ops, so that torch.compile keeps them inside its graphs."""

    @torch.library.register_fake("llmserve::int4_gemv")
    def _(x, packed, n, activation_parts=2):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("llmserve::int8_gemv")
    def _(x, packed, scales, n, activation_parts=2):
        return x.new_empty(x.shape[0], n)
