"""The pool of fixed-size KV blocks: who holds which block, which are free, which are cached.

A block is free when its reference count is zero. Free blocks wait in an LRU queue: the block freed
longest ago is reused first. With prefix caching, a full block keeps its hash when freed and stays
findable (`lookup`) until the pool hands it out again; a hit takes it back out of the free queue.
Requests free their blocks tail first, so the deepest blocks of a sequence are evicted first and a
shared prefix outlives the suffixes that hang off it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmserve.kv_cache.block_hash import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens behind the hash, to rule out collisions


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, 0..1 (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """n blocks with ref_cnt 1, least recently freed first; their old cache entries are evicted."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self._free.popitem(last=False)[0]]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None  # a miss, or a hash collision caught by the token comparison
        return block

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Register a full, computed block under its hash (the first block with a hash keeps it)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self._cached.setdefault(block_hash, block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = block.token_ids = None
