"""Attention over one whole sequence with no KV cache: how calibrations (AWQ, key smoothing) run the model.

Why a backend rather than a forward of their own: a calibration then runs the very forward that serves
(`DecoderForCausalLM.forward_sequence` swaps this in for the layers' serving backend), so every family's norms,
windows, rotary tables and experts are the ones it measures, and the model's math is written once. Not in the
build plan's registry: it serves no step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.layers.attention.backend import AttentionBackend


class WholeSequenceAttention(AttentionBackend):
    """Causal attention of one sequence (the step's tokens are positions 0..T-1 of one request), sliding
    windows as the serving backends mask them; the caches and metadata are ignored (None)."""

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window: int = 0) -> torch.Tensor:
        repeat = q.shape[1] // k.shape[1]
        # [1, heads, T, head_dim]: with a batch dimension PyTorch's CPU flash kernel takes it (without, its
        # math fallback, far slower on long sequences)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)))
        if window:  # the query at p attends p - window < k <= p
            pos = torch.arange(q.shape[2], device=q.device)
            allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return o[0].transpose(0, 1)
