"""A step's attention indices, built once (`attention_metadata`, called by the model runner) and shared by every
layer: where each new token's K/V goes, the decodes' part (each backend's own form), the prompt chunks' spans, and
the cache's row gathers and writes both backends use. The cache layout is the package's (`layers/attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from llmserve.kv_cache.kv_quant import dequantize_rows, is_quantized, quantize_rows

if TYPE_CHECKING:
    from llmserve.layers.attention.backend import AttentionBackend


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
    # this step's sliding-window variants by window, built by `windowed` on a windowed layer's first call
    _windows: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False, compare=False)

    def windowed(self, window: int, block_size: int) -> AttentionMetadata:
        """This step's metadata for sliding-window attention over the last `window` positions: the decode groups'
        bias and the prefill chunks' masks banded (a chunk's context gathered from the first block any of its
        queries sees), the native kernel's batch as it is (the kernel takes the window). Built once per step and
        window, then shared by every layer with that window."""
        if window not in self._windows:
            decodes = self.decodes
            if not isinstance(decodes, DecodeBatch):
                decodes = [replace(group, bias=windowed_bias(group.bias, window)) for group in decodes]
            prefills = [windowed_span(span, window, block_size, self.write_slots.device) for span in self.prefills]
            self._windows[window] = AttentionMetadata(self.write_slots, decodes, prefills)
        return self._windows[window]


def attention_metadata(
    backend: AttentionBackend,
    tables: list[list[int]],  # each row's block table; decodes first, by context length
    row_of_token: torch.Tensor | None,  # [T] the row of each token of the flat batch (None: one token a row)
    positions: torch.Tensor,  # [T]
    counts: list[int],  # tokens each row runs now
    starts: list[int],  # tokens each row has computed
    first_token: list[int],  # each row's first token in the flat batch
    block_size: int,
    num_kv_heads: int,
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionMetadata:
    """A step's attention indices, built once with batched tensor ops and shared by every layer. A decode-only step's
    come from `tables` in Python instead, a tensor each, where every op counts in a small step: its K/V slots, and on
    the native kernel its block table."""
    bs = block_size
    num_decodes = sum(1 for n in counts if n == 1)
    continued = any(starts[row] for row in range(num_decodes, len(counts)))  # prompt chunks after the first
    block_table = None  # [rows, max_blocks], padded with block 0: for what the lists do not give
    if num_decodes < len(counts) or backend.gathers_head_rows or continued:
        block_table = padded_tables(tables, torch.long)
    if num_decodes == len(counts):  # one token a row, at position starts[row]
        write_slots = torch.tensor([(table[start // bs] * num_kv_heads + head) * bs + start % bs
                                    for table, start in zip(tables, starts, strict=True)
                                    for head in range(num_kv_heads)], device=device)
    else:
        write_slots = cache_slots(block_table[row_of_token, positions // bs], positions, bs,
                                  num_kv_heads).flatten().to(device)
    if backend.prompt_tokens_as_decodes and num_decodes < len(counts):
        # every token a decode row of its own: its request's block table, its own context (through itself)
        table = padded_tables(tables, torch.int32, min_width=2)[row_of_token]
        decodes = DecodeBatch(len(positions), table.to(device), (positions + 1).to(torch.int32).to(device))
        return AttentionMetadata(write_slots, decodes, [])
    head_rows = cache_rows(block_table, num_kv_heads) if backend.gathers_head_rows or continued else None
    decodes = backend.decode_metadata(tables[:num_decodes], head_rows, starts[:num_decodes], bs, num_heads, dtype,
                                      device)
    prefills = []
    for row in range(num_decodes, len(counts)):
        start, n, first = starts[row], counts[row], first_token[row]
        if start == 0:
            prefills.append(PrefillSpan(first, first + n, None, n, None))
            continue
        ctx = start + n
        rows = head_rows[row, :, : -(-ctx // bs)].flatten().to(device)
        # bottom-right causal: query i (position start + i) sees keys 0 .. start + i
        mask = torch.arange(ctx).unsqueeze(0) <= (torch.arange(n) + start).unsqueeze(1)
        prefills.append(PrefillSpan(first, first + n, rows, ctx, mask.to(device)))
    return AttentionMetadata(write_slots, decodes, prefills)


def padded_tables(tables: list[list[int]], dtype: torch.dtype, device: torch.device | str = "cpu",
                  min_width: int = 1) -> torch.Tensor:
    """[rows, max_blocks] (at least `min_width` columns): the block tables in one tensor, padded with block 0."""
    width = max([min_width, *map(len, tables)])
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=dtype,
                        device=device).view(len(tables), width)


def cache_slots(blocks: torch.Tensor, positions: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """[T, kv_heads]: the rows of the cache seen as [slots, head_dim] where the K/V of tokens at `positions`, in
    `blocks`, go (slot = (block * kv_heads + head) * block_size + offset)."""
    heads = torch.arange(num_kv_heads, device=blocks.device)
    return ((blocks * num_kv_heads).unsqueeze(1) + heads) * block_size + (positions % block_size).unsqueeze(1)


def cache_rows(block_table: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[rows, kv_heads, max_blocks]: each request's rows of the (block, kv head) view of the cache."""
    heads = torch.arange(num_kv_heads, device=block_table.device)
    return block_table.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)


def windowed_bias(bias: torch.Tensor, window: int) -> torch.Tensor:
    """A decode group's bias [B, num_heads, L] with -inf also on the keys older than the last `window` positions.
    Each decode's context length is its bias's count of zeros (the padding after it is -inf): derived on the bias's
    device, with no host sync, so a captured CUDA graph's bias (engine/cuda_graphs.py) works as a step's does."""
    if bias.shape[-1] <= window:  # no key can be older than the window
        return bias
    context = (bias[:, :1] == 0).sum(-1, keepdim=True)  # [B, 1, 1]
    older = torch.arange(bias.shape[-1], device=bias.device) < context - window
    return bias.masked_fill(older, float("-inf"))


def windowed_span(span: PrefillSpan, window: int, block_size: int, device: torch.device) -> PrefillSpan:
    """A prefill chunk's span for sliding-window attention: its mask banded to each query's last `window` positions,
    and a continued chunk's context gathered from the block of the earliest key any of its queries sees (the rows
    are [kv_heads * blocks], head-major)."""
    n = span.end - span.start
    if span.context_len <= window:  # every key within every query's window: the causal mask as it is
        return span
    if span.context_rows is None:  # a fresh chunk longer than the window
        query, key = torch.arange(n, device=device).unsqueeze(1), torch.arange(n, device=device)
        return replace(span, mask=(key <= query) & (key > query - window))
    first = span.context_len - n  # the chunk's first position
    skipped = max(0, first - window + 1) // block_size * block_size  # whole blocks before every query's window
    blocks = -(-span.context_len // block_size)
    rows = span.context_rows.view(-1, blocks)[:, skipped // block_size :].flatten()
    query = torch.arange(first, span.context_len, device=device).unsqueeze(1)
    key = torch.arange(skipped, span.context_len, device=device)
    return PrefillSpan(span.start, span.end, rows, span.context_len - skipped, (key <= query) & (key > query - window))


def padding_bias(padding: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, num_heads, L]: 0 where a decode may attend, -inf where `padding` [B, L] is set."""
    bias = torch.zeros(padding.shape, dtype=dtype, device=padding.device).masked_fill_(padding, float("-inf"))
    return bias.unsqueeze(1).expand(-1, num_heads, -1).contiguous()


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, kv_heads, head_dim] into the cache's (token, kv head) rows at `slots` [T * kv_heads],
    quantized first where the cache is (as the native write_kv does)."""
    rows = x.reshape(-1, x.shape[-1])
    if is_quantized(cache.dtype):  # copied as bytes: index_copy_ has no float8 kernel
        cache.view(torch.uint8).view(-1, cache.shape[3]).index_copy_(
            0, slots, quantize_rows(rows, cache.dtype).view(torch.uint8))
    else:
        cache.view(-1, cache.shape[3]).index_copy_(0, slots, rows)


def gather_rows(cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (block, kv head) rows `rows` of the cache, [len(rows), block_size, head_dim] in `dtype`: only
    these are dequantized, never the whole cache. index_select is several times faster than advanced
    indexing on CPU."""
    if not is_quantized(cache.dtype):
        return cache.view(-1, cache.shape[2], cache.shape[3]).index_select(0, rows)
    raw = cache.view(torch.uint8).view(-1, cache.shape[2], cache.shape[3]).index_select(0, rows)
    return dequantize_rows(raw.view(cache.dtype), dtype)
