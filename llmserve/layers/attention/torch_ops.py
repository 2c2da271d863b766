"""The PyTorch backend: decodes as a few padded batches of similar context length, prompt chunks on SDPA."""

from __future__ import annotations

import torch

from llmserve.layers.attention.backend import AttentionBackend, prefills_into
from llmserve.layers.attention.metadata import DecodeGroup, gather_rows, padding_bias, write_rows


class TorchAttention(AttentionBackend):
    """PyTorch ops only (other devices, or no compiler): decodes as a few padded batches of similar context
    length, two batched matmuls each, several times faster on CPU than SDPA for a one-token query."""

    def decode_metadata(self, block_table, head_rows, context_starts, block_size, num_heads, dtype,
                        device) -> list[DecodeGroup]:
        groups = []
        for start, end in decode_groups([-(-(c + 1) // block_size) for c in context_starts]):
            ctx = torch.tensor(context_starts[start:end]) + 1
            max_blocks = -(-int(ctx[-1]) // block_size)  # sorted: the last is the longest
            rows = head_rows[start:end, :, :max_blocks].flatten().to(device)
            padding = torch.arange(max_blocks * block_size) >= ctx.unsqueeze(1)  # [B, max_blocks * bs]
            bias = padding_bias(padding, num_heads, dtype).to(device)
            groups.append(DecodeGroup(start, end, rows, bias))
        return groups

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window: int = 0) -> torch.Tensor:
        write_rows(k_cache, meta.write_slots, k)
        write_rows(v_cache, meta.write_slots, v)
        if window:
            meta = meta.windowed(window, k_cache.shape[2])
        if len(meta.decodes) == 1 and not meta.prefills:  # the common decode-only step: no output copy
            return _decode_attention(q, k_cache, v_cache, meta.decodes[0], scale)
        out = torch.empty_like(q)
        for group in meta.decodes:
            out[group.start : group.end] = _decode_attention(q[group.start : group.end], k_cache, v_cache, group,
                                                             scale)
        prefills_into(out, q, k, v, k_cache, v_cache, meta, scale)
        return out


# What one more decode group costs beyond the KV it gathers (the per-call overhead of its ~6 ops in every
# layer), in units of one request's block: measured on CPU, a group's overhead is about the gather of 64.
GROUP_OVERHEAD_BLOCKS = 64


def decode_groups(num_blocks: list[int]) -> list[tuple[int, int]]:
    """Split decodes sorted by context length into contiguous groups `[start, end)` that minimise the
    gathered blocks (each padded to its group's longest) plus a fixed cost per group: an exact
    O(B^2) dynamic programme over at most max_num_seqs decodes."""
    n = len(num_blocks)
    best = [0] + [0x7FFFFFFF] * n  # best[j]: cost of grouping the first j decodes
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # last group is [i, j), padded to num_blocks[j - 1]
            cost = best[i] + GROUP_OVERHEAD_BLOCKS + (j - i) * num_blocks[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    while n:
        groups.append((cut[n], n))
        n = cut[n]
    return groups[::-1]


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
) -> torch.Tensor:
    # GQA without copying K/V per query head: the G query heads that share a KV head become G query
    # rows against that head's keys: [B*kv_heads, G, D] x [B*kv_heads, D, ctx].
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    keys = gather_rows(k_cache, group.rows, q.dtype).view(b * num_kv_heads, -1, head_dim)
    values = gather_rows(v_cache, group.rows, q.dtype).view(b * num_kv_heads, -1, head_dim)
    qg = q.reshape(b * num_kv_heads, num_heads // num_kv_heads, head_dim)
    bias = group.bias.view(qg.shape[0], qg.shape[1], -1)
    scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, values).view(b, num_heads, head_dim)
