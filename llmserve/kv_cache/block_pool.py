"""The pool of fixed-size KV blocks: who holds which block, and which are free.

A block is free when its reference count is zero. Free blocks wait in a FIFO queue, so the block
freed longest ago is reused first (the order prefix caching will rely on to keep recent blocks).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """n fresh blocks with ref_cnt 1. Raises if fewer are free (callers check first)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self._free.popleft()]
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block.block_id)
