"""Chained block hashes: the identity of a full KV block is its tokens *and* everything before them.

hash(block i) = hash(hash(block i-1), token ids of block i, extra keys such as a tenant's cache
salt). Two requests share block i only if they agree on every token up to its end, so a hash
lookup finds the longest shared prefix block by block. Python's tuple hash of ints is
deterministic and 64-bit; a collision is caught by comparing the block's stored token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

BlockHash = int


def hash_block(parent: BlockHash | None, token_ids: tuple[int, ...], extra: str | None = None) -> BlockHash:
    return hash((parent, token_ids, extra))


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra: str | None = None
) -> None:
    """Append the hashes of the full blocks of token_ids not hashed yet (in place, incremental)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra))
