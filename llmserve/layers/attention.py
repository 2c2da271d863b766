"""Attention over the paged KV cache.

KV cache layout, per layer (one tensor for K, one for V):

    [num_blocks, num_kv_heads, block_size, head_dim]
     └─ block id                └─ offset of a token in its block

A token at position p of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`. Keeping a head's tokens of a block contiguous (block_size x head_dim) means that
gathering a request's context for one KV head is a gather of whole rows of
`cache.view(num_blocks * num_kv_heads, block_size, head_dim)`: the result is already laid out
`[kv_heads, context, head_dim]`, ready for a batched matmul, with no transpose copy.

Index tensors are built once per step by the model runner (`AttentionMetadata`) and shared by all
layers. The flat token batch is ordered decodes first (one query token each, shortest context first), then
prefill chunks. On CPU, decodes go to the native kernel (`llmserve/kernels/paged_attention.cpp`), which
reads each request's blocks in place through its block table: no gathered copy, no padding, one call per
layer. The PyTorch path (other devices, or no compiler) runs decodes as padded batches with two batched
matmuls each, several times faster on CPU than SDPA for a one-token query. They are split into a few
groups of similar context length, so one long request does not pad every short one to its length (16
decodes at 200 tokens beside one at 2,000 would otherwise gather 5x the KV they need).
Each prefill chunk runs on its own through SDPA (a step carries few of them).
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
    # Rows of the (block, kv head) view holding the whole context, [kv_heads * n_blocks], and the context
    # length; None when the chunk *is* the whole context: its fresh K/V are used, no gather needed.
    context_rows: torch.Tensor | None
    context_len: int
    # [q, ctx] bool, True = may attend; None means plain causal over the chunk.
    mask: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Decodes `[start, end)` of the flat batch, attended as one padded batch."""

    start: int
    end: int
    rows: torch.Tensor  # [B * kv_heads * max_blocks] rows to gather (padding: any valid block)
    bias: torch.Tensor  # [B, num_heads, max_blocks * block_size], 0 or -inf (padding)


@dataclass
class DecodeBatch:
    """All decodes `[0, size)` of the flat batch, for the native kernel."""

    size: int
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32, the new token included


@dataclass
class AttentionMetadata:
    # [T * kv_heads]: where each new token's K/V row goes in the cache seen as [slots, head_dim]
    # (slot = (block * kv_heads + head) * block_size + offset): one index_copy_ writes a whole step.
    write_slots: torch.Tensor
    # single-token decodes, at the front of the batch: a DecodeBatch for the native kernel, else groups
    decodes: DecodeBatch | list[DecodeGroup]
    prefills: list[PrefillSpan]


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, num_heads, head_dim].

    A decode-only step on the native kernels is two custom ops, which torch.compile keeps inside a
    compiled layer's graph; every other step runs eagerly (a graph break)."""
    if isinstance(meta.decodes, DecodeBatch) and not meta.prefills:
        torch.ops.llmserve.write_kv(k, v, k_cache, v_cache, meta.write_slots)
        return _native_decode(q, k_cache, v_cache, meta.decodes, scale)
    return _paged_attention_eager(q, k, v, k_cache, v_cache, meta, scale)


# Data-dependent Python (a loop over this step's decode groups and prefill spans): torch.compile
# would re-trace it for every batch shape, so a compiled layer calls it as an opaque eager function.
@torch.compiler.disable
def _paged_attention_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    decodes = meta.decodes
    if isinstance(decodes, DecodeBatch):  # the native kernels are loaded: one op writes K and V
        torch.ops.llmserve.write_kv(k, v, k_cache, v_cache, meta.write_slots)
        out = torch.empty_like(q)
        if decodes.size:
            out[: decodes.size] = _native_decode(q[: decodes.size], k_cache, v_cache, decodes, scale)
    else:
        head_dim = k.shape[-1]
        k_cache.view(-1, head_dim).index_copy_(0, meta.write_slots, k.reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, meta.write_slots, v.reshape(-1, head_dim))
        if len(decodes) == 1 and not meta.prefills:  # the common decode-only step: no output copy
            return _decode_attention(q, k_cache, v_cache, decodes[0], scale)
        out = torch.empty_like(q)
        for group in decodes:
            out[group.start : group.end] = _decode_attention(q[group.start : group.end], k_cache, v_cache, group, scale)
    for span in meta.prefills:
        out[span.start : span.end] = _prefill_attention(q, k, v, k_cache, v_cache, span, scale)
    return out


def _native_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float
) -> torch.Tensor:
    return torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, batch.block_table, batch.context_lens, scale)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [num_blocks * kv_heads, block_size, head_dim]: one row per (block, kv head).
    Gathered with index_select, several times faster than advanced indexing on CPU."""
    return cache.view(-1, cache.shape[2], cache.shape[3])


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    # GQA without copying K/V per query head: the G query heads that share a KV head become G query
    # rows against that head's keys: [B*kv_heads, G, D] x [B*kv_heads, D, ctx].
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    keys = _rows(k_cache).index_select(0, group.rows).view(b * num_kv_heads, -1, head_dim)
    values = _rows(v_cache).index_select(0, group.rows).view(b * num_kv_heads, -1, head_dim)
    qg = q.reshape(b * num_kv_heads, num_heads // num_kv_heads, head_dim)
    bias = group.bias.view(qg.shape[0], qg.shape[1], -1)
    scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, values).view(b, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if span.context_rows is None:
        ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q, D]
        vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
    else:
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
        ks = _rows(k_cache).index_select(0, span.context_rows).view(1, num_kv_heads, -1, head_dim)
        vs = _rows(v_cache).index_select(0, span.context_rows).view(1, num_kv_heads, -1, head_dim)
        ks, vs = ks[:, :, : span.context_len], vs[:, :, : span.context_len]
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)
