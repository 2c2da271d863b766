"""Chained block hashes: the identity of a full KV block is its tokens *and* everything before them.

hash(block i) = sha256(hash(block i-1), token ids of block i, extra keys such as a tenant's cache
salt). Two requests share block i only if they agree on every token up to its end, so a hash
lookup finds the longest shared prefix block by block. A stable digest, not Python's `hash()` (salted
per process for strings): every process computes the same hashes for the same tokens and salt, so a
tensor-parallel worker, a gateway that routes by prefix and a restarted server agree on a prefix.
A collision is still caught by comparing the block's stored token ids.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes of sha256

_NO_PARENT = b""


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: str | None = None) -> BlockHash:
    digest = hashlib.sha256(parent or _NO_PARENT)
    digest.update(b"\x00" if parent is None else b"\x01")
    tokens = array("q", token_ids)  # int64, little-endian whatever the host
    if sys.byteorder == "big":
        tokens.byteswap()
    digest.update(tokens.tobytes())
    if extra is not None:
        digest.update(b"\x02" + extra.encode("utf-8", "surrogatepass"))
    return digest.digest()[:16]


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra: str | None = None
) -> None:
    """Append the hashes of the full blocks of token_ids not hashed yet (in place, incremental)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
