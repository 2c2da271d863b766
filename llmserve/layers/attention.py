"""Attention over the paged KV cache.

KV cache layout, per layer (one tensor for K, one for V; kv_cache/kv_cache_spec.py):

    [num_blocks, num_kv_heads, block_size, head_dim]
     └─ block id                └─ offset of a token in its block

A token at position p of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`. Keeping a head's tokens of a block contiguous (block_size x head_dim) means that
gathering a request's context for one KV head is a gather of whole rows of
`cache.view(num_blocks * num_kv_heads, block_size, head_dim)`: the result is already laid out
`[kv_heads, context, head_dim]`, ready for a batched matmul, with no transpose copy.

Index tensors are built once per step (`attention_metadata`, called by the model runner) and shared by
all layers. The flat token batch is ordered decodes first (one query token each, shortest context first),
then prefill chunks. Two backends, one chosen by the build plan: on CPU, `NativeAttention` sends decodes
to the C++ kernel (`llmserve/kernels/paged_attention.cpp`), which reads each request's blocks in place
through its block table: no gathered copy, no padding, one call per layer. `TorchAttention` (other
devices, or no compiler) runs decodes as padded batches with two batched matmuls each, several times
faster on CPU than SDPA for a one-token query. They are split into a few groups of similar context
length, so one long request does not pad every short one to its length (16 decodes at 200 tokens
beside one at 2,000 would otherwise gather 5x the KV they need). Each prefill chunk runs on its own
through SDPA (a step carries few of them).

Sliding-window attention (Mistral, Gemma 3's local layers) is a per-call `window`: the same step's metadata serves
windowed and full layers alike (Gemma 3 interleaves them), so each window's masks are derived from it on first use
and kept on it for the step's other layers (`AttentionMetadata.windowed`); the native kernel takes the window itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from llmserve.kv_cache.kv_cache_spec import KVCacheSpec
from llmserve.kv_cache.kv_quant import QUANTIZED_KV_DTYPES, dequantize_rows, is_quantized, quantize_rows


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


class AttentionBackend:
    """How attention runs over the paged cache: the decodes' metadata the runner builds for it (once per
    step, shared by every layer), and the layer's attention. Chosen once, by the build plan; every layer
    holds the same one."""

    # whether `decode_metadata` reads `head_rows` (each request's (block, KV head) rows): built only for those that do
    gathers_head_rows = True

    def kv_cache_spec(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                      dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
        """The cache this backend reads and writes: the layout above, in the model dtype (`kv_cache_dtype`
        auto) or as 1-byte rows with their scales (int8, fp8_e4m3: kv_cache/kv_quant.py). Both backends
        here read every format."""
        stored = dtype if kv_cache_dtype == "auto" else QUANTIZED_KV_DTYPES[kv_cache_dtype]
        return KVCacheSpec(num_layers, num_kv_heads, head_dim, block_size, stored)

    def decode_metadata(self, tables: list[list[int]], head_rows: torch.Tensor | None, context_starts: list[int],
                        block_size: int, num_heads: int, dtype: torch.dtype,
                        device: torch.device) -> DecodeBatch | list[DecodeGroup]:
        """The decodes' part of a step's metadata. tables: the decodes' block tables (sorted by context), head_rows
        (where `gathers_head_rows`) the step's rows of the (block, kv head) cache view [rows, kv_heads, max_blocks],
        decodes first; context_starts the decodes' computed tokens."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend. q [T, heads, head_dim], k and v
        [T, kv_heads, head_dim]; returns [T, heads, head_dim].

        `window` 0: causal attention over the whole context. `window` W > 0: sliding-window attention as
        transformers masks it for Mistral and Gemma 3's sliding layers (masking_utils'
        sliding_window_causal_mask_function: `kv_idx > q_idx - W` and `kv_idx <= q_idx`): the query at position p
        attends the keys at positions k with p - W < k <= p, its last W positions, itself included."""
        raise NotImplementedError

    def stay_eager_in_compiled_graphs(self) -> None:
        """Before torch.compile traces a model holding this backend: the Python it should not trace (a loop over
        a step's groups and spans, re-traced for every batch shape) becomes an opaque eager call in the graph.
        Done here, when a graph is about to be compiled, rather than by decorators at import: those import
        torch._dynamo (a cost to every start, on a plan that compiles nothing; docs/performance.md, "Start-up") and
        put its wrapper on every eager call."""
        self.forward = torch.compiler.disable(self.forward)


class NativeAttention(AttentionBackend):
    """Decodes on llmserve's C++ kernel (CPU): each request's blocks read in place through its block table.

    A decode-only step is two custom ops, which torch.compile keeps inside a compiled graph; a step with
    prompt tokens runs eagerly (a graph break)."""

    gathers_head_rows = False  # the kernel walks each block table itself

    def __init__(self) -> None:
        self._mixed = _native_mixed  # a step with prompt tokens

    def decode_metadata(self, tables, head_rows, context_starts, block_size, num_heads, dtype,
                        device) -> DecodeBatch:
        # The kernel's int32 table made from the lists, one op: each op counts on the caches a step's weight stream
        # leaves (a long table sliced and converted would be three). At least 2 columns: a compiled graph
        # specialises on a size of 1, and short contexts would otherwise need a variant of their own.
        return DecodeBatch(len(tables), padded_tables(tables, torch.int32, device, min_width=2),
                           torch.tensor([start + 1 for start in context_starts], dtype=torch.int32, device=device))

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window: int = 0) -> torch.Tensor:
        torch.ops.llmserve.write_kv(k, v, k_cache, v_cache, meta.write_slots)
        if not meta.prefills:
            return _native_decode(q, k_cache, v_cache, meta.decodes, scale, window)
        return self._mixed(q, k, v, k_cache, v_cache, meta, scale, window)

    def stay_eager_in_compiled_graphs(self) -> None:
        """Only a step with prompt tokens: its data-dependent Python runs eagerly (a graph break); a decode-only
        step's two custom ops stay inside the graph."""
        self._mixed = torch.compiler.disable(_native_mixed)


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
        _prefills_into(out, q, k, v, k_cache, v_cache, meta, scale)
        return out


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"native": NativeAttention, "torch": TorchAttention}


def _native_mixed(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """A step with prompt tokens on the native path: the decodes on the kernel, each prompt chunk on SDPA."""
    if window:
        meta = meta.windowed(window, k_cache.shape[2])
    out = torch.empty_like(q)
    if meta.decodes.size:
        out[: meta.decodes.size] = _native_decode(q[: meta.decodes.size], k_cache, v_cache, meta.decodes, scale,
                                                  window)
    _prefills_into(out, q, k, v, k_cache, v_cache, meta, scale)
    return out


def _prefills_into(out, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> None:
    for span in meta.prefills:
        out[span.start : span.end] = _prefill_attention(q, k, v, k_cache, v_cache, span, scale)


def _native_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float, window: int = 0
) -> torch.Tensor:
    return torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, batch.block_table, batch.context_lens, scale,
                                                     window)


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
        num_kv_heads, head_dim = k_cache.shape[1], q.shape[2]
        ks = gather_rows(k_cache, span.context_rows, q.dtype).view(1, num_kv_heads, -1, head_dim)
        vs = gather_rows(v_cache, span.context_rows, q.dtype).view(1, num_kv_heads, -1, head_dim)
        ks, vs = ks[:, :, : span.context_len], vs[:, :, : span.context_len]
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)
