"""What one layer's KV cache looks like, as its attention backend declares it: the block count follows
from a memory budget and `bytes_per_block`, and the runner allocates exactly `shape(num_blocks)`.

Layout, per layer (one tensor for K, one for V; see layers/attention/__init__.py):

    [num_blocks, num_kv_heads, block_size, head_dim]
     └─ block id                └─ offset of a token in its block

A quantized cache (`dtype` int8 or float8_e4m3fn) stores each row's float32 scale after its values:
rows of head_dim + 4 one-byte elements (kv_cache/kv_quant.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmserve.kv_cache.kv_quant import row_width
from llmserve.os_pages import anonymous_pages


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # as stored: the model dtype, or int8 / float8_e4m3fn (quantized rows)

    @property
    def bytes_per_block(self) -> int:
        """One block's K and V in every layer."""
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.row_width * element

    @property
    def row_width(self) -> int:
        """Elements of one (token, KV head) row."""
        return row_width(self.head_dim, self.dtype)

    def shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.row_width)

    def allocate(self, num_blocks: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) per layer. Zeros, not empty: padded decode gathers read arbitrary slots, which must be finite.
        On the CPU, pages the kernel zeroes as they are first touched (`anonymous_pages`): `torch.zeros` writes every
        byte first, time and resident memory at every start, for a cache a short-lived or lightly loaded server never
        fills (docs/performance.md, "Start-up")."""
        shape = self.shape(num_blocks)

        def zeros() -> torch.Tensor:
            if torch.device(device).type == "cpu":
                return anonymous_pages(math.prod(shape) * self.dtype.itemsize).view(self.dtype).view(shape)
            return torch.zeros(shape, dtype=self.dtype, device=device)

        return [(zeros(), zeros()) for _ in range(self.num_layers)]
