"""Decode-only steps on a GPU replayed as CUDA graphs.

Why: on CUDA the decoder runs layer by layer on PyTorch's ops, and a step of SmolLM2's shape is ~1,900 kernel
launches that Python issues one by one, so a small step spends most of its time launching kernels rather than
running them (docs/performance.md, "CUDA"). Captured once, a step is one replay.

Shapes: a graph is captured per (batch, context) size class: the batch padded up to 1, 2, 4, 8, then multiples
of 8, and every request's context to a power-of-two number of blocks, so a few dozen graphs cover every decode
step the plan sends here. A graph's inputs are three static tensors each step fills (token ids, positions, the
block table); everything else the attention needs (KV write slots, the rows to gather, the padding bias) is
computed inside the graph from them. Padded rows write their K/V to a spare block past those the KV manager hands
out, and attend to that slot alone. Graphs are captured at the first step of their size class (all rows padding
then, so capturing touches the spare block only), in one memory pool they share.

Built with `capture=False` (no GPU), the same step runs eagerly on the static tensors: the tests check on the
CPU that a padded step computes what the plain one does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.layers.attention import AttentionMetadata, DecodeGroup, cache_rows, cache_slots, padding_bias

# Rows a graph takes: the batch sizes captured (and padded up to); a larger decode step runs eagerly, where
# launches are a smaller share of its time.
MAX_GRAPH_BATCH = 64


def batch_size_classes(max_batch: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds `max_batch` (at most MAX_GRAPH_BATCH)."""
    sizes = [1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)]
    return [b for b in sizes if b < max_batch] + [next(b for b in sizes if b >= max_batch)]


@dataclass
class _Graph:
    input_ids: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    block_table: torch.Tensor  # [batch, blocks], padded with the spare block
    output: torch.Tensor | None = None  # hidden states [batch, hidden], rewritten by each replay
    replay: Callable[[], None] | None = None


class CudaGraphs:
    """The decode-only steps of one model and KV cache, replayed per size class."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], spare_block: int,
                 block_size: int, max_blocks: int, max_batch: int, capture: bool = True) -> None:
        """`spare_block`: a block of every layer's cache that no request owns (padded rows write there);
        `max_blocks`: the most blocks a request's context takes (max_model_len)."""
        self.model = model
        self.kv_caches = kv_caches
        self.spare_block = spare_block
        self.block_size = block_size
        k_cache = kv_caches[0][0]
        self.device = k_cache.device
        self.num_kv_heads = k_cache.shape[1]
        self.num_heads = model.config.num_heads
        self.dtype = next(model.parameters()).dtype
        self.batch_classes = batch_size_classes(max_batch)
        self.block_classes = [1 << i for i in range((max_blocks - 1).bit_length() + 1)]
        self.capture = capture
        self._offsets = torch.arange(self.block_classes[-1] * block_size, device=self.device)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def captured(self) -> set[tuple[int, int]]:
        """The (batch, blocks) size classes captured so far."""
        return set(self._graphs)

    def __call__(self, token_ids: list[int], starts: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [len(token_ids), hidden] of one new token per request (at position `starts[i]`, after
        the context its block table holds). The tensor is the graph's own: read it before the next step."""
        batch = len(token_ids)
        padded = next(b for b in self.batch_classes if b >= batch)
        need = max(-(-(s + 1) // self.block_size) for s in starts)
        blocks = next(b for b in self.block_classes if b >= need)
        graph = self._graphs.get((padded, blocks)) or self._capture(padded, blocks)
        spare, pad = self.spare_block, padded - batch
        table = [t[:blocks] + [spare] * (blocks - len(t[:blocks])) for t in block_tables] + [[spare] * blocks] * pad
        graph.input_ids.copy_(torch.tensor(token_ids + [0] * pad), non_blocking=True)
        graph.positions.copy_(torch.tensor(starts + [0] * pad), non_blocking=True)
        graph.block_table.copy_(torch.tensor(table), non_blocking=True)
        graph.replay()
        return graph.output[:batch]

    def _forward(self, graph: _Graph) -> torch.Tensor:
        """The step on the graph's static tensors: the attention's indices from the block table (as
        `attention_metadata` builds them for the PyTorch backend, one decode group), then the model."""
        bs, kv = self.block_size, self.num_kv_heads
        table, positions = graph.block_table, graph.positions
        batch, blocks = table.shape
        write_slots = cache_slots(table.gather(1, (positions // bs).unsqueeze(1)).squeeze(1), positions, bs, kv)
        padding = self._offsets[: blocks * bs].unsqueeze(0) > positions.unsqueeze(1)  # past the new token
        bias = padding_bias(padding, self.num_heads, self.dtype)
        meta = AttentionMetadata(write_slots.flatten(), [DecodeGroup(0, batch, cache_rows(table, kv).flatten(), bias)],
                                 [])
        return self.model(graph.input_ids, positions, self.kv_caches, meta)

    def _capture(self, batch: int, blocks: int) -> _Graph:
        def zeros() -> torch.Tensor:
            return torch.zeros(batch, dtype=torch.long, device=self.device)

        graph = _Graph(zeros(), zeros(), torch.full((batch, blocks), self.spare_block, device=self.device))
        if not self.capture:
            def run() -> None:
                graph.output = self._forward(graph)
            graph.replay = run
        else:
            # warmed up once on a side stream (lazy initialisations must not happen inside a capture), then
            # captured; every row is padding meanwhile, so both write the spare block only
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(graph)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self._pool):
                graph.output = self._forward(graph)
            graph.replay = cuda_graph.replay
        self._graphs[(batch, blocks)] = graph
        return graph
