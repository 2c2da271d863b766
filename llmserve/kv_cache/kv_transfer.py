"""A prompt's KV blocks moved from one instance to another: what a prefill instance hands a decode instance when
prefill and decode run apart (disaggregated serving: Splitwise, DistServe, vLLM's KV connectors).

Why keyed by the block hashes: they are stable across processes (block_hash.py), so the decode instance can name the
prompt's blocks before it has computed anything, and the prefill instance finds them in its prefix cache as any later
request of its own would. The sender looks the blocks up with their tokens (a hash collision is refused as in a local
lookup) and copies the leading run it still holds; the receiver writes them into free blocks and registers them in its
own prefix cache, free and evictable, so the request that follows finds them as a prefix hit and computes only the
rest. Nothing is held on either side between two calls: a transfer that fails, a request that never comes or an
instance that dies leaves no block taken, and a block evicted before it is imported is computed by the decode
instance itself (slower, never wrong).

Both calls run in the engine's thread between two steps (the caches and the pool are the step's). The bytes are each
block's K then V in every layer, in the cache's own layout and dtype: `KVFormat` says what they are, and the receiver
refuses bytes of another format (model, weights, dtype, block size, layer and head shapes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from llmserve.kv_cache.block_hash import BlockHash
from llmserve.kv_cache.block_pool import BlockPool, KVBlock


class KVFormatError(ValueError):
    """Blocks that are not of this instance's format, or not whole."""


@dataclass(frozen=True)
class KVFormat:
    """What one block's bytes are: the model and weights whose K/V they hold, and the cache's layout."""

    model: str
    weights: str
    dtype: str  # the cache's stored dtype (torch's name)
    block_size: int
    num_layers: int
    num_kv_heads: int
    row_width: int  # elements of one (token, KV head) row (a quantized cache's scale included)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.row_width * element

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KVFormat:
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as e:
            raise KVFormatError(f"not a KV format: {text[:200]!r} ({e})") from None

    def check(self, theirs: KVFormat) -> None:
        """KVFormatError naming each field where `theirs` differs from this instance's."""
        mine, other = asdict(self), asdict(theirs)
        if differ := [f"{k} {other[k]!r} (here {mine[k]!r})" for k in mine if mine[k] != other[k]]:
            raise KVFormatError("the sender's KV blocks are of another format: " + ", ".join(differ))


def _lookup_run(pool: BlockPool, block_hashes: list[BlockHash], token_ids: list[int], block_size: int
                ) -> list[KVBlock | None]:
    """Each named block as this pool holds it (None where it does not)."""
    return [pool.lookup(h, tuple(token_ids[i * block_size:(i + 1) * block_size])) for i, h in enumerate(block_hashes)]


def export_blocks(pool: BlockPool, caches: list[tuple[torch.Tensor, torch.Tensor]], block_hashes: list[BlockHash],
                  token_ids: list[int], block_size: int) -> tuple[int, bytes]:
    """The leading run of the named blocks this pool still holds: how many, and their bytes (layer by layer, K then
    V, block by block). `token_ids`: the tokens of those blocks, for the collision check."""
    found = _lookup_run(pool, block_hashes, token_ids, block_size)
    run = next((i for i, block in enumerate(found) if block is None), len(found))
    if not run:
        return 0, b""
    index = torch.tensor([block.block_id for block in found[:run]])
    data = torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index))) for k, v in caches])
    return run, data.view(torch.uint8).numpy().tobytes()


def import_blocks(pool: BlockPool, caches: list[tuple[torch.Tensor, torch.Tensor]], fmt: KVFormat, sent: KVFormat,
                  count: int, payload: bytes, block_hashes: list[BlockHash], token_ids: list[int]) -> int:
    """Write `count` sent blocks (the leading ones of `block_hashes`) into free blocks and register them in the prefix
    cache, free and evictable; blocks already held here are kept as they are. Returns how many blocks were written:
    fewer when the free blocks run out (the rest, and all after them, are computed here). KVFormatError, changing
    nothing, for another format or bytes that are not `count` whole blocks."""
    fmt.check(sent)
    if count > len(block_hashes) or len(token_ids) < count * fmt.block_size:
        raise KVFormatError(f"{count} blocks sent for a prompt of {len(block_hashes)} full blocks")
    if len(payload) != count * fmt.bytes_per_block:
        raise KVFormatError(f"{len(payload)} bytes sent for {count} blocks of {fmt.bytes_per_block}")
    if not count:
        return 0
    found = _lookup_run(pool, block_hashes[:count], token_ids, fmt.block_size)
    held = [block for block in found if block is not None]
    pool.touch(held)  # so that taking free blocks below cannot evict them
    missing = [i for i, block in enumerate(found) if block is None]
    room = pool.num_free_blocks
    missing = missing[:room]  # past the first block that finds no room, nothing is of use: those are computed here
    taken = pool.allocate(len(missing))
    try:
        if taken:
            shape = (fmt.num_layers, 2, len(found), fmt.num_kv_heads, fmt.block_size, fmt.row_width)
            data = torch.frombuffer(bytearray(payload), dtype=getattr(torch, fmt.dtype)).view(shape)
            rows = torch.tensor(missing)
            index = torch.tensor([block.block_id for block in taken])
            for layer, (k, v) in enumerate(caches):
                k.index_copy_(0, index, data[layer, 0].index_select(0, rows))
                v.index_copy_(0, index, data[layer, 1].index_select(0, rows))
            bs = fmt.block_size
            for i, block in zip(missing, taken, strict=True):
                pool.cache(block, block_hashes[i], tuple(token_ids[i * bs:(i + 1) * bs]))
    finally:  # deepest first, as a finished request frees its table: a prefix outlives what hangs off it
        chain = sorted([*zip(missing, taken, strict=True), *((i, b) for i, b in enumerate(found) if b is not None)],
                       key=lambda pair: pair[0], reverse=True)
        pool.free([block for _, block in chain])
    return len(taken)
