"""Attention over the paged KV cache.

KV cache layout, per layer (one tensor for K, one for V):

    [num_blocks, block_size, num_kv_heads, head_dim]
     └─ block id   └─ slot in block

A token's *slot* is `block_id * block_size + offset`; viewing the cache as
`[num_blocks * block_size, num_kv_heads, head_dim]` makes a slot a row index. New K/V are written
with one `index_copy_` per layer through `slot_mapping`; attention reads a request's context through
slot indices built from its block table once per step (`AttentionMetadata`), shared by all layers.

The flat token batch is ordered decodes first (one query token each), then prefill chunks. Decodes
run as one padded batch; each prefill chunk runs on its own (a step carries few of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One request's chunk of query tokens `[start, end)` in the flat batch."""

    start: int
    end: int
    # Slots of the whole context (cached prefix + this chunk), or None when the chunk *is* the whole
    # context: then the chunk's own fresh K/V are used and no gather is needed.
    context_slots: torch.Tensor | None
    # [q, ctx] bool, True = may attend; None means plain causal over the chunk.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    decode_slots: torch.Tensor | None  # [B, max_ctx] context slots per decode (padding: any valid slot)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_ctx] bool, True = real context
    prefills: list[PrefillSpan]


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, num_heads, head_dim]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    b = meta.num_decodes
    if b:
        out[:b] = _decode_attention(q[:b], k_flat, v_flat, meta, scale)
    for span in meta.prefills:
        out[span.start : span.end] = _prefill_attention(q, k, v, k_flat, v_flat, span, scale)
    return out


def _decode_attention(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    # GQA without copying K/V per query head: the G query heads that share a KV head become G query
    # rows against that head's keys, [B, kv_heads, G, D] x [B, kv_heads, ctx, D].
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    group = num_heads // num_kv_heads
    keys = k_flat[meta.decode_slots].transpose(1, 2)  # [B, kv_heads, ctx, D]
    values = v_flat[meta.decode_slots].transpose(1, 2)
    qg = q.view(b, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(b, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if span.context_slots is None:
        ks = k[span.start : span.end]
        vs = v[span.start : span.end]
    else:
        ks = k_flat[span.context_slots]
        vs = v_flat[span.context_slots]
    ks = ks.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, D]
    vs = vs.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)
