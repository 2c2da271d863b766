"""The weight layout of the AMX int8 product (`int8_gemm.cpp`), and the op's shape for torch.compile.

Packing is plain tensor reshuffling, done once at load: the packed weight holds exactly the int8 values
it was given, so the product's int32 sums are those of the unpacked weight.
"""

from __future__ import annotations

import torch

STRIP = 32  # output channels per strip: out_features must be a multiple of it
STEP = 64  # inputs per tile step: in_features must be a multiple of it
ZERO_POINT = 128  # the activations' zero point (uint8 around 128, as int8_activations.py quantizes them)


def int8_gemm_packs(out_features: int, in_features: int) -> bool:
    return out_features % STRIP == 0 and in_features % STEP == 0


def pack_int8_for_amx(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, in] int8. Returns the flat layout `llmserve::int8_gemm` reads (per strip of 32 channels, per
    64 inputs, two 16-channel tiles whose row r holds each channel's inputs 4r..4r+3) and the zero-point
    compensation, 128 * each channel's weight sum (int32)."""
    out_features, in_features = q.shape
    if not int8_gemm_packs(out_features, in_features):
        raise ValueError(
            f"int8 AMX packing needs out_features a multiple of {STRIP} and in_features % {STEP} == 0,"
            f" got {tuple(q.shape)}"
        )
    tiles = q.view(out_features // STRIP, 2, 16, in_features // STEP, 16, 4)  # [strip, tile, col, step, row, k]
    packed = tiles.permute(0, 3, 1, 4, 2, 5).contiguous().view(-1)
    compensation = (q.to(torch.int32).sum(dim=1) * ZERO_POINT).to(torch.int32)
    return packed, compensation


def register_fakes() -> None:
    """Output shape of the op, so that torch.compile keeps it inside its graphs."""

    @torch.library.register_fake("llmserve::int8_gemm")
    def _(xu, row_scales, packed, w_scales, compensation, out_dtype):
        return xu.new_empty(xu.shape[0], w_scales.shape[0], dtype=out_dtype)
