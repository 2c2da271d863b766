"""Per-request block tables over the block pool, and the prefix cache's lookups.

The scheduler asks which leading blocks of a request are already cached (`get_computed_blocks`),
then for room for the tokens it is about to run (`allocate_slots`): yes (hits and new blocks
appended to the request's table) or no (nothing changed; the caller preempts or waits). After a
step, `cache_blocks` registers the blocks that became full and `trim` gives back the tail of tokens
that were run but not kept. Finished and aborted requests give every block back through `free`.
The scheduler is this manager's only user.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.kv_cache.block_hash import BlockHash, extend_block_hashes
from llmserve.kv_cache.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    usage: float  # fraction of blocks held by requests
    num_cached_blocks: int  # findable by hash, in use or free
    prefix_queries: int
    prefix_hits: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # blocks of each table already registered in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def stats_snapshot(self) -> KVCacheStats:
        return KVCacheStats(self.num_blocks, self.num_free_blocks, self.usage, self.pool.num_cached_blocks,
                            self.stats.queries, self.stats.hits)

    def reset_stats(self) -> None:
        """Forget the prefix-cache counts (the engine's own warm-up and calibration are nobody's traffic)."""
        self.stats = PrefixCacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(
        self, token_ids: list[int], block_hashes: list[BlockHash], extra: str | None = None
    ) -> tuple[list[KVBlock], int]:
        """The longest run of leading full blocks already in the cache, and the tokens they hold.

        `block_hashes` is the request's own list, extended in place. At least one token is always
        left to compute: its logits are what the request samples from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        limit = (len(token_ids) - 1) // bs
        extend_block_hashes(block_hashes, token_ids[: limit * bs], bs, extra)
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(block_hashes[:limit]):
            block = self.pool.lookup(block_hash, tuple(token_ids[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix lookup (not retries of one that had to wait)."""
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Grow the request's table (cache hits first) to hold num_total_tokens tokens; returns the ids of
        the blocks it gained, or None, changing nothing, when the free blocks do not suffice."""
        computed_blocks = computed_blocks or []
        table = self._tables.get(request_id, [])
        missing = self.blocks_needed(num_total_tokens) - len(table) - len(computed_blocks)
        hits_on_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # these leave the free queue
        if max(missing, 0) + hits_on_free > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        table = self._tables.setdefault(request_id, [])
        start = len(table)
        table.extend(computed_blocks)
        if computed_blocks:
            self._num_cached[request_id] = len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return [b.block_id for b in table[start:]]

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens' (the tail of tokens run but not kept)."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table and len(table) > keep:
            tail, table[keep:] = table[keep:], []
            self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), keep)
            self.pool.free(list(reversed(tail)))

    def cache_blocks(self, request_id: str, token_ids: list[int], block_hashes: list[BlockHash],
                     num_computed_tokens: int, extra: str | None = None) -> None:
        """Register the request's blocks that are full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        full = min(num_computed_tokens // self.block_size, len(table))
        done = self._num_cached.get(request_id, 0)
        if full <= done:
            return
        extend_block_hashes(block_hashes, token_ids[: full * self.block_size], self.block_size, extra)
        bs = self.block_size
        for i in range(done, full):
            self.pool.cache(table[i], block_hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]))
        self._num_cached[request_id] = full

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def free(self, request_id: str) -> None:
        # Tail first: the deepest blocks of a sequence are evicted before the prefix they extend.
        self._num_cached.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(list(reversed(table)))
