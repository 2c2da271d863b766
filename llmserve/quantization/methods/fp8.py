"""FP8 (e4m3) weights: one byte a weight, a float32 scale per output row and block of 128 inputs.

A weight read from an FP8 checkpoint (loader/fp8_format.py: vLLM's per-tensor or per-channel scales, DeepSeek's
128 x 128 blocks) keeps the file's bytes and scales (`Checkpoint.fp8_grids`); any other weight (`--quantization fp8`
on a dense model) is fitted per output channel, scale = max|w| / 448 (e4m3's largest value), q = w / scale rounded to
the nearest e4m3 value. Small steps run `kernels/fp8_gemv.cpp`'s `fp8_gemv` (the bytes widened to float32 in
registers, the activations as they are) where it is built; without it every step takes the dense product of the
same values, as PyTorch has no weight-only fp8 product on the CPU.
"""

from __future__ import annotations

import torch

from llmserve.kernels.fp8_gemv import FP8_BLOCK, fp8_blocks, fp8_packs, pack_fp8
from llmserve.quantization.methods.base import LinearMethod, PreparedWeight, SmallStep

FP8_MAX = 448.0  # e4m3fn's largest finite value


class Fp8Method(LinearMethod):
    def native_packs(self, out_features: int, in_features: int) -> bool:
        return fp8_packs(out_features, in_features)

    def prepare(self, weight: torch.Tensor, grid: tuple[torch.Tensor, ...] | None, native: bool,
                dense: bool = True) -> PreparedWeight:
        levels = None if grid is None else fp8_levels(weight, grid[0])
        layout = "e4m3, the file's scales"
        if levels is None:
            levels = fp8_levels(weight, channel_scales(weight), check=False)
            layout = "e4m3 per channel"
        q, scales, dequantized = levels
        if native:
            return PreparedWeight(pack_fp8(q, scales), None, dequantized if dense else None, layout)
        return PreparedWeight(None, None, dequantized, layout)

    def small_step(self, native: bool) -> SmallStep:
        return _native_fp8 if native else _dense_fp8


def _native_fp8(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.llmserve.fp8_gemv(x, layer.qweight, layer.out_features, layer.activation_parts)


def _dense_fp8(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """PyTorch's: the dense product of the dequantized values (`prepare` keeps no fp8 copy for it)."""
    return torch.nn.functional.linear(x, layer.weight)


def expand_blocks(scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """[out, ceil(in / 128)] scales as one per weight, [out, in]."""
    return scales.repeat_interleave(FP8_BLOCK, dim=1)[:, :in_features]


def channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per output channel, max|w| / 448 in float32 (1 for a row of zeros), as [out, ceil(in / 128)] blocks."""
    out_features, in_features = weight.shape
    scale = weight.detach().abs().amax(dim=1).float() / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale.unsqueeze(1).expand(out_features, fp8_blocks(in_features)).contiguous()


def fp8_levels(weight: torch.Tensor, scales: torch.Tensor, check: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q float8_e4m3fn [out, in], scales, q * scale in float32) on `scales` [out, ceil(in / 128)]: q is w / scale
    rounded to the nearest e4m3 value (within e4m3's range). `check`: None unless those values give the weight in its
    own dtype (a file's grid: a weight changed since it was read does not keep it). A file's w = q * scale, rounded to
    float32 or bf16, divides back to q exactly: the rounding moves w / scale by far less than half an e4m3 step."""
    out_features, in_features = weight.shape
    if scales.shape != (out_features, fp8_blocks(in_features)):
        return None
    per_weight = expand_blocks(scales.float(), in_features)
    ratio = weight.detach().float() / torch.where(per_weight != 0, per_weight, 1)
    q = ratio.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    dequantized = q.float().mul_(per_weight)
    if check and not torch.equal(dequantized.to(weight.dtype), weight.detach()):
        return None
    return q, scales.float().contiguous(), dequantized


def quantize_fp8_blocks(weight: torch.Tensor, block_rows: int = FP8_BLOCK
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style blocks: q float8_e4m3fn [out, in] and one scale per block of `block_rows` x 128 weights,
    max|w| / 448 over the block, float32 [ceil(out / block_rows), ceil(in / 128)]."""
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // block_rows), fp8_blocks(in_features)
    padded = torch.zeros(rows * block_rows, cols * FP8_BLOCK)
    padded[:out_features, :in_features] = weight.detach().float().abs()
    block_scale = padded.view(rows, block_rows, cols, FP8_BLOCK).amax(dim=(1, 3)) / FP8_MAX
    block_scale = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    levels = fp8_levels(weight, block_scale.repeat_interleave(block_rows, dim=0)[:out_features], check=False)
    return levels[0], block_scale
