"""Weight layouts for the native quantized products (`quantized_gemv.cpp`), and the ops' shapes for
torch.compile.

The kernels read weights in the order their loops consume them (see the C++ file's header for the byte
layout), so each linear layer keeps a packed copy made once at load. Packing is plain tensor reshuffling:
the packed weight holds exactly the quantized values it was given.
"""

from __future__ import annotations

from typing import Literal

import torch

from llmserve import kernels  # the package imports this module: `kernels.native_op` is looked up when called

ROWS = 16  # output rows per row block: out_features must be a multiple of it
INT4_GROUP = 32  # inputs per scale and minimum


def int4_packs(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % INT4_GROUP == 0


def int8_packs(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % INT4_GROUP == 0


SUPER_GROUPS = 8  # groups of 32 per super-block (256 inputs, Q4_K's block)


def super_block_factors(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """values [out, in / 32] (an int4 layer's scales or minimums) as factor [out, in / 256] (fp16 values) times
    u [out, in / 32] (integers in [0, 255]), exactly in float32, or None where some super-block of 8 groups has
    no such factors. Q4_K's are d * sc and -dmin * m with 6-bit sc and m, the largest of each block 63 in the
    files llama.cpp writes: that is tried first, then, where a few blocks need it, any other largest integer up to
    255 (a search each layer's blocks do not all get: it stops at a grid that is not a K-quant one)."""
    out_features, groups = values.shape
    if groups % SUPER_GROUPS:
        return None
    v = values.float().reshape(-1, SUPER_GROUPS)
    largest = v.gather(1, v.abs().argmax(dim=1, keepdim=True))  # the signed value of largest size

    def fit(ref: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block (and candidate multiple k of the factor in `ref`): the factor, the integers, whether exact."""
        factor = (ref / k).half().float()
        u = torch.where(factor != 0, blocks / torch.where(factor != 0, factor, 1), 0).round()
        exact = ((u * factor == blocks) & (u >= 0) & (u <= 255)).all(dim=-1)
        return factor, u, exact

    factor, u, exact = fit(largest, v, torch.tensor(63.0))
    misses = (~exact).nonzero().squeeze(1)
    if len(misses) > max(64, len(v) // 16):  # not a K-quant grid: a full search would cost 255 tries a block
        return None
    if len(misses):
        k = torch.arange(1, 256, dtype=torch.float32)
        f, q, ok = fit(largest[misses, None], v[misses, None], k[:, None])  # [misses, 255, 1 / 8 / -]
        if not ok.any(dim=1).all():
            return None
        first = ok.float().argmax(dim=1)  # the largest factor that fits
        factor[misses] = f[torch.arange(len(misses)), first]
        u[misses] = q[torch.arange(len(misses)), first]
    return factor.view(out_features, groups // SUPER_GROUPS).half(), u.view(out_features, groups).to(torch.uint8)


# (scale factor, scale u8, minimum factor, minimum u8): `super_block_factors` of an int4 layer's scales and minimums
SuperBlocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def super_blocks(scales: torch.Tensor, mins: torch.Tensor) -> SuperBlocks | None:
    """Both factorings, or None unless both exist (the minimums are not searched once the scales failed)."""
    scale = super_block_factors(scales)
    minimum = super_block_factors(mins) if scale is not None else None
    return None if minimum is None else (*scale, *minimum)


def _per_row_block(values: torch.Tensor) -> torch.Tensor:
    """[out, n] per-row values -> [out / 16, n, 16 rows] as bytes: a row block's 16 values of each column side by side,
    as the kernels' headers hold scales."""
    rows = values.reshape(-1, ROWS, values.shape[1]).transpose(1, 2).contiguous()
    return rows.view(torch.uint8).view(rows.shape[0], rows.shape[1], -1)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              factored: SuperBlocks | None | Literal["find"] = "find", native: bool | None = None) -> torch.Tensor:
    """q [out, in] integers in [0, 15]; scales, mins [out, in / 32] (w = q * scale + min).
    Returns the flat uint8 layout `llmserve::int4_gemv` reads: the super-block one where both scales and minimums
    factor per 256 inputs (`super_blocks`: Q4_K grids, exactly), else the one with fp16 scales and minimums.
    `factored`: `super_blocks(scales, mins)` where the caller has it already (None: the fp16 layout), else found
    here. `native`: the nibbles by `pack_layouts.cpp` (default where the kernels are loaded) or PyTorch's ops."""
    out_features, in_features = q.shape
    if not int4_packs(out_features, in_features):
        raise ValueError(f"int4 packing needs out_features % {ROWS} == 0 and in_features % {INT4_GROUP} == 0")
    blocks, groups = out_features // ROWS, in_features // INT4_GROUP
    q = q.to(torch.uint8)
    if (op := kernels.native_op("int4_nibbles", q, native)) is not None:  # pack_layouts.cpp: the same bytes
        nibbles = op(q.contiguous())
    else:  # byte (vector c, row r, slot s) of a group = q[r, 8c + s] | q[r, 8c + 4 + s] << 4
        q = q.view(blocks, ROWS, groups, 4, 2, 4)  # [block, row, group, c, nibble, s]
        nibbles = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256)
    if factored == "find":
        factored = super_blocks(scales, mins)
    if factored is None:
        fp16 = [_per_row_block(scales.half()), _per_row_block(mins.half())]
        return torch.cat([nibbles, *fp16], dim=2).contiguous().view(-1)
    scale_factor, scale_u, min_factor, min_u = factored
    supers = groups // SUPER_GROUPS
    factors = torch.cat([_per_row_block(scale_factor), _per_row_block(min_factor)], dim=2)  # [block, super, 64]
    u8 = torch.cat([_per_row_block(scale_u), _per_row_block(min_u)], dim=2).view(blocks, supers, -1)  # 8 groups x 32
    return torch.cat([factors, u8, nibbles.view(blocks, supers, -1)], dim=2).contiguous().view(-1)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] int8 (or uint8 holding q + 128, as `signed_levels` gives it). Returns the flat uint8 layout
    `llmserve::int8_gemv` reads: per block of 16 rows and group of 32 inputs, 8 vectors of 64 bytes, vector c
    holding inputs 4c..4c+3 of each row in turn, as q + 128 (the kernel multiplies unsigned weight bytes by signed
    activation bytes)."""
    out_features, in_features = q.shape
    if not int8_packs(out_features, in_features):
        raise ValueError(f"int8 packing needs out_features % {ROWS} == 0 and in_features % {INT4_GROUP} == 0")
    unsigned = q if q.dtype == torch.uint8 else (q.to(torch.int16) + 128).to(torch.uint8)
    # [block, row, group, c, s] -> [block, group, c, row, s]
    blocks = unsigned.view(out_features // ROWS, ROWS, in_features // INT4_GROUP, 8, 4)
    return blocks.permute(0, 2, 3, 1, 4).contiguous().view(-1)


def pack_int8_grouped(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [out, in] integers in [-128, 127] (as `pack_int8` takes them), d [out, in / 32] (fp16 values), w = d * q:
    GGUF Q8_0's and Q5_0's values. Returns the flat uint8 layout `llmserve::int8_gemv` reads as its grouped one (its
    row scales ones): per block of 16 rows and group of 32 inputs, `pack_int8`'s 512 bytes, then the 16 rows' d as
    fp16."""
    out_features, in_features = q.shape
    if not int8_packs(out_features, in_features):
        raise ValueError(f"int8 packing needs out_features % {ROWS} == 0 and in_features % {INT4_GROUP} == 0")
    blocks, groups = out_features // ROWS, in_features // INT4_GROUP
    body = pack_int8(q).view(blocks, groups, -1)
    return torch.cat([body, _per_row_block(d.half())], dim=2).contiguous().view(-1)


INT6_SUPER = 256  # inputs per d (Q6_K's block): in_features must be a multiple of it
INT6_SUB = 16  # inputs per sc


def int6_packs(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % INT6_SUPER == 0


def pack_int6(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, native: bool | None = None) -> torch.Tensor:
    """q [out, in] integers in [0, 63], d [out, in / 256] (float32 values), sc [out, in / 16] int8, w = d * sc *
    (q - 32): GGUF Q6_K's values. Returns the flat uint8 layout `llmserve::int8_gemv` reads as its 6-bit one (its
    row scales ones): per block of 16 rows and 256 inputs a header (d as float32, then per group of 32 the int8 sc
    of its two halves), then per group q's low nibbles as `pack_int4` orders them and q's top 2 bits (see the
    C++ file). `native`: as `pack_int4`'s."""
    out_features, in_features = q.shape
    if not int6_packs(out_features, in_features):
        raise ValueError(f"6-bit packing needs out_features % {ROWS} == 0 and in_features % {INT6_SUPER} == 0")
    blocks, groups, supers = out_features // ROWS, in_features // INT4_GROUP, in_features // INT6_SUPER
    q = q.to(torch.uint8)
    if (op := kernels.native_op("int6_group_bytes", q, native)) is not None:  # pack_layouts.cpp: the same bytes
        group_bytes = op(q.contiguous())
    else:
        low = (q & 15).view(blocks, ROWS, groups, 4, 2, 4)  # [block, row, group, c, nibble, s]
        nibbles = (low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [block, group, c, row, s]
        # input 8c + 4h + s with c = 2v + c2: top bits of vector v, at bit 2 (2 c2 + h)
        top = (q >> 4).view(blocks, ROWS, groups, 2, 2, 2, 4)  # [block, row, group, v, c2, h, s]
        shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).view(1, 1, 1, 1, 2, 2, 1)
        top = (top << shifts).sum(dim=(4, 5), dtype=torch.uint8).permute(0, 2, 3, 1, 4)  # [block, group, v, row, s]
        group_bytes = torch.cat([nibbles.reshape(blocks, groups, -1), top.reshape(blocks, groups, -1)], dim=2)

    header = torch.cat([_per_row_block(d.float()).view(blocks, supers, -1),  # [block, super, 64]
                        _per_row_block(sc.to(torch.int8)).view(blocks, supers, -1)], dim=2)  # and 16 halves x 16
    body = group_bytes.view(blocks, supers, -1)
    return torch.cat([header, body], dim=2).contiguous().view(-1)


def register_fakes() -> None:
    """Output shapes of the ops, so that torch.compile keeps them inside its graphs."""

    @torch.library.register_fake("llmserve::int4_gemv")
    def _(x, packed, n, activation_parts=2):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("llmserve::int8_gemv")
    def _(x, packed, scales, n, activation_parts=2):
        return x.new_empty(x.shape[0], n)
