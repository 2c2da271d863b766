"""Rotary position embedding (the rotate-half convention of Hugging Face Llama checkpoints).

cos/sin are tabulated once for every position up to the context length; a step looks its
positions up once and every layer reuses the result.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths are stretched, short ones kept, smooth between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        # rotate-half negates the first half of the rotated vector; folding that sign into sin turns
        # the rotation into a roll: rotate_half(x) * sin == x.roll(half) * signed_sin
        signed_sin = emb.sin()
        signed_sin[:, : head_dim // 2] *= -1
        self.register_buffer("signed_sin_cache", signed_sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for these positions: [T, 1, head_dim], ready to broadcast over heads."""
        return (
            self.cos_cache[positions].to(dtype).unsqueeze(1),
            self.signed_sin_cache[positions].to(dtype).unsqueeze(1),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, native: bool = False) -> torch.Tensor:
    """x: [T, heads, head_dim] (any strides); returns a new contiguous tensor. `native`: one op of
    kernels/fused_elementwise.cpp (x's heads adjacent, each contiguous) instead of four."""
    if native:
        return torch.ops.llmserve.rotary(x, cos, signed_sin)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
