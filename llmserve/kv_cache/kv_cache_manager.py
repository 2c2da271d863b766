"""Per-request block tables over the block pool.

The scheduler asks for room for the tokens it is about to run (`allocate_slots`); the manager
answers yes (blocks appended to the request's table) or no (nothing changed, the caller preempts
or waits). Finished and aborted requests give every block back through `free`.
"""

from __future__ import annotations

from llmserve.kv_cache.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's table to hold num_total_tokens tokens; False (and no change) if it can't."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_total_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def free(self, request_id: str) -> None:
        # Freed in reverse so a sequence's tail blocks are reused before its head.
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(list(reversed(table)))
