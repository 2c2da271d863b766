"""Turns a scheduler decision into one forward pass and one sampling call.

Per step: the scheduled requests are ordered decodes first, their new tokens flattened into one
vector, and every index the attention needs (slot mapping, per-decode context slots, per-prefill
masks) is built once with batched tensor ops from a padded block-table tensor. Logits are computed
only for the rows that sample (the last token of a request whose tokens are all computed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.engine.decode_graph import DecodeGraph
from llmserve.engine.request import Request
from llmserve.kv_cache.kv_cache_manager import KVCacheManager
from llmserve.layers.attention import AttentionMetadata, DecodeBatch, DecodeGroup, PrefillSpan
from llmserve.layers.sampler import SampledToken, SamplingMetadata, sample
from llmserve.models.llama import LlamaConfig


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        native_attention: bool = False,
        compile_decode: bool = False,
        native_argmax: bool = False,
    ) -> None:
        self.model = model
        self.native_attention = native_attention  # decodes through llmserve/kernels (needs them loaded)
        self.native_argmax = native_argmax  # greedy tokens through llmserve/kernels (needs them loaded)
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)  # see layers/attention.py
        # Zero-filled, not empty: padded decode gathers read arbitrary slots, which must be finite.
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
        # decode-only steps as one compiled graph (needs the native kernels; see decode_graph.py)
        self.decode_graph = DecodeGraph(model, self.kv_caches) if compile_decode else None

    @torch.inference_mode()
    def execute(
        self, scheduled: list[tuple[Request, int]], kv_cache: KVCacheManager
    ) -> list[SampledToken | None]:
        """Run the scheduled tokens; returns, per scheduled entry, its sampled token or None."""
        # decodes (one new token) first, shortest context first: they form the decode groups of the attention
        order = sorted(range(len(scheduled)), key=lambda i: (scheduled[i][1] != 1, scheduled[i][0].num_computed_tokens))
        reqs = [scheduled[i][0] for i in order]
        counts = [scheduled[i][1] for i in order]
        starts = [r.num_computed_tokens for r in reqs]
        token_ids: list[int] = []
        for r, s, n in zip(reqs, starts, counts, strict=True):
            token_ids.extend(r.all_token_ids[s : s + n])

        dev = self.device
        tables = [kv_cache.block_ids(r.request_id) for r in reqs]
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        counts_t = torch.tensor(counts)
        starts_t = torch.tensor(starts)
        if len(token_ids) == len(reqs):  # one token each (a decode-only step): row i is token i
            row_of_token = first_token = torch.arange(len(reqs))
            positions = starts_t
        else:  # repeat_interleave alone was ~35 us, 1 % of a batch-1 step
            row_of_token = torch.repeat_interleave(torch.arange(len(reqs)), counts_t)
            first_token = torch.cumsum(counts_t, 0) - counts_t
            positions = torch.arange(len(token_ids)) - first_token[row_of_token] + starts_t[row_of_token]
        meta = self._attention_metadata(block_table, row_of_token, positions, counts, starts, first_token.tolist())
        sample_rows = [i for i, r in enumerate(reqs) if starts[i] + counts[i] == r.num_tokens]
        decode_only = isinstance(meta.decodes, DecodeBatch) and not meta.prefills
        # steps the model runs as one native call (LlamaForCausalLM.takes_fused_decode) need no graph
        compiled = self.decode_graph and decode_only and not self.model.takes_fused_decode(meta, len(token_ids))
        forward = self.decode_graph if compiled else self.model
        hidden = forward(torch.tensor(token_ids, device=dev), positions.to(dev), self.kv_caches, meta)
        results: list[SampledToken | None] = [None] * len(scheduled)
        if not sample_rows:
            return results
        if len(sample_rows) < len(token_ids):  # else every token samples (decodes only): all of hidden
            hidden = hidden[(first_token + counts_t - 1)[sample_rows].to(dev)]
        logits = self.model.compute_logits(hidden)
        sampled = sample(logits, self._sampling_metadata([reqs[i] for i in sample_rows], logits.shape[1]),
                         self.native_argmax)
        for row, token in zip(sample_rows, sampled, strict=True):
            results[order[row]] = token
        return results

    def _attention_metadata(
        self,
        block_table: torch.Tensor,  # [rows, max_blocks], padded with block 0
        row_of_token: torch.Tensor,
        positions: torch.Tensor,
        counts: list[int],
        starts: list[int],
        first_token: list[int],
    ) -> AttentionMetadata:
        dev, bs, width = self.device, self.block_size, block_table.shape[1]
        num_kv_heads = self.config.num_kv_heads
        write_blocks = block_table[row_of_token, positions // bs]
        write_slots = ((write_blocks * num_kv_heads).unsqueeze(1) + torch.arange(num_kv_heads)) * bs + (
            positions % bs
        ).unsqueeze(1)  # [T, kv_heads]
        # rows of the (block, kv head) view of the cache, per request: [rows, kv_heads, max_blocks]
        head_rows = block_table.unsqueeze(1) * num_kv_heads + torch.arange(num_kv_heads).view(1, -1, 1)
        num_decodes = sum(1 for n in counts if n == 1)
        if self.native_attention:
            # at least 2 columns: a compiled graph specialises on a size of 1, and short contexts would
            # otherwise need a variant of their own
            table = block_table[:num_decodes] if width > 1 else F.pad(block_table[:num_decodes], (0, 1))
            decodes: DecodeBatch | list[DecodeGroup] = DecodeBatch(
                num_decodes,
                table.to(device=dev, dtype=torch.int32),
                torch.tensor(starts[:num_decodes], dtype=torch.int32, device=dev) + 1,
            )
        else:
            decodes = self._decode_groups(head_rows, starts[:num_decodes])
        prefills = []
        for row in range(num_decodes, len(counts)):
            start, n, first = starts[row], counts[row], first_token[row]
            if start == 0:
                prefills.append(PrefillSpan(first, first + n, None, n, None))
                continue
            ctx = start + n
            rows = head_rows[row, :, : -(-ctx // bs)].flatten().to(dev)
            # bottom-right causal: query i (position start + i) sees keys 0 .. start + i
            mask = torch.arange(ctx).unsqueeze(0) <= (torch.arange(n) + start).unsqueeze(1)
            prefills.append(PrefillSpan(first, first + n, rows, ctx, mask.to(dev)))
        return AttentionMetadata(write_slots.flatten().to(dev), decodes, prefills)

    def _decode_groups(self, head_rows: torch.Tensor, starts: list[int]) -> list[DecodeGroup]:
        """The PyTorch path's decodes: padded groups of similar context length (see `_decode_groups`)."""
        dev, bs, num_heads = self.device, self.block_size, self.config.num_heads
        groups = []
        for start, end in _decode_groups([-(-(c + 1) // bs) for c in starts]):
            ctx = torch.tensor(starts[start:end]) + 1
            max_blocks = -(-int(ctx[-1]) // bs)  # sorted: the last is the longest
            rows = head_rows[start:end, :, :max_blocks].flatten().to(dev)
            padding = torch.arange(max_blocks * bs) >= ctx.unsqueeze(1)  # [B, max_blocks * bs]
            bias = torch.zeros(padding.shape, dtype=self.kv_caches[0][0].dtype).masked_fill_(padding, float("-inf"))
            bias = bias.unsqueeze(1).expand(-1, num_heads, -1).contiguous().to(dev)
            groups.append(DecodeGroup(start, end, rows, bias))
        return groups

    def _sampling_metadata(self, reqs: list[Request], vocab_size: int) -> SamplingMetadata:
        params = [r.params for r in reqs]
        dev = self.device
        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32,
                                   device=dev)
        all_greedy = all(p.greedy for p in params)
        top_k = top_p = min_p = None
        if not all_greedy:
            if any(p.top_k > 0 for p in params):
                # top_k at or past the vocabulary keeps every token
                top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                                     device=dev)
            if any(p.top_p < 1 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        counts = prompt_mask = presence = frequency = repetition = None
        if any(p.uses_penalties for p in params):
            counts = torch.zeros(len(reqs), vocab_size, device=dev)
            prompt_mask = torch.zeros(len(reqs), vocab_size, dtype=torch.bool, device=dev)
            for i, r in enumerate(reqs):
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
                prompt_mask[i, torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)] = True
            presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
        banned = [
            (i, ([] if r.params.ignore_eos else r.eos_token_ids) + r.params.stop_token_ids)
            for i, r in enumerate(reqs)
            if r.num_output_tokens < r.params.min_tokens
        ]
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=all_greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=[r.generator for r in reqs],
            output_counts=counts,
            prompt_mask=prompt_mask,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            banned=banned,
            num_logprobs=[p.logprobs for p in params],
        )


# What one more decode group costs beyond the KV it gathers (the per-call overhead of its ~6 ops in every
# layer), in units of one request's block: measured on CPU, a group's overhead is about the gather of 64.
GROUP_OVERHEAD_BLOCKS = 64


def _decode_groups(num_blocks: list[int]) -> list[tuple[int, int]]:
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
