"""What one layer's KV cache looks like, as its attention backend declares it: the block count follows
from a memory budget and `bytes_per_block`, and the runner allocates exactly `shape(num_blocks)`.

Layout, per layer (one tensor for K, one for V; see layers/attention.py):

    [num_blocks, num_kv_heads, block_size, head_dim]
     └─ block id                └─ offset of a token in its block

A quantized cache (`dtype` int8 or float8_e4m3fn) stores each row's float32 scale after its values:
rows of head_dim + 4 one-byte elements (kv_cache/kv_quant.py).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from llmserve.kv_cache.kv_quant import row_width


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
        On the CPU the zeros are pages the kernel zeroes as they are first touched (`zero_pages`)."""
        shape = self.shape(num_blocks)
        if torch.device(device).type == "cpu":
            return [(zero_pages(shape, self.dtype), zero_pages(shape, self.dtype)) for _ in range(self.num_layers)]
        return [(torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype,
                                                                                   device=device))
                for _ in range(self.num_layers)]


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on an anonymous private mapping: the kernel maps each page to zeros when it is first
    touched, so a cache sized for the whole budget costs nothing at start and becomes resident as blocks are used.
    `torch.zeros` writes every byte first: 0.6 s and 2.3 GB resident at the start of the 135M default, whose cache
    a short-lived or lightly loaded server never fills (benchmarks/README.md, session 54)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # holds a reference to the mapping
