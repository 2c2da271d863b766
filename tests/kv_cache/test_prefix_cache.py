"""Prefix caching in the block pool and manager, with exact block ids and eviction order."""

from __future__ import annotations

from llmserve.kv_cache.block_hash import extend_block_hashes, hash_block
from llmserve.kv_cache.block_pool import BlockPool
from llmserve.kv_cache.kv_cache_manager import KVCacheManager

BS = 4


def admit(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> tuple[list[int], int]:
    """Look the prompt up, allocate it whole, mark it computed; returns (block ids, cached tokens)."""
    hashes: list[int] = []
    hits, num_hit = kv.get_computed_blocks(tokens, hashes, salt)
    assert kv.allocate_slots(rid, len(tokens), hits) is not None
    kv.cache_blocks(rid, tokens, hashes, len(tokens), salt)
    return kv.block_ids(rid), num_hit


def test_chained_hashes_depend_on_every_earlier_token_and_the_salt():
    a, b, c = [], [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    extend_block_hashes(b, [0, 2, 3, 4, 5, 6, 7, 8], BS)
    extend_block_hashes(c, [1, 2, 3, 4, 5, 6, 7, 8], BS, "tenant")
    assert len(a) == 2  # only full blocks
    assert a[0] == hash_block(None, (1, 2, 3, 4)) and a[1] == hash_block(a[0], (5, 6, 7, 8))
    assert a[1] != b[1]  # same block tokens, different prefix
    assert not set(a) & set(c)


def test_second_request_shares_the_prefix_blocks():
    kv = KVCacheManager(10, BS)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    ids_a, hit_a = admit(kv, "a", prompt)
    ids_b, hit_b = admit(kv, "b", prompt[:8] + [7, 7, 7])
    assert hit_a == 0 and ids_a == [0, 1, 2]
    assert hit_b == 8 and ids_b == [0, 1, 3]  # shared blocks 0 and 1, its own tail
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 10


def test_whole_prompt_hit_still_leaves_one_token_to_compute():
    kv = KVCacheManager(10, BS)
    prompt = list(range(8))  # exactly 2 blocks
    admit(kv, "a", prompt)
    kv.free("a")
    hits, num_hit = kv.get_computed_blocks(prompt, [])
    assert [b.block_id for b in hits] == [0] and num_hit == 4  # block 1 is recomputed for its logits


def test_freed_blocks_stay_findable_until_reused_lru_and_deepest_first():
    kv = KVCacheManager(6, BS)
    prompt = list(range(12)) + [99]
    admit(kv, "a", prompt)  # blocks 0, 1, 2 full and cached, 3 partial
    kv.free("a")  # tail first: the free queue is now 4, 5, 3, 2, 1, 0
    assert kv.pool.num_cached_blocks == 3
    assert kv.allocate_slots("b", 8) == [4, 5] and kv.block_ids("b") == [4, 5]  # never-used blocks first
    assert kv.pool.num_cached_blocks == 3
    assert kv.allocate_slots("c", 8) == [3, 2] and kv.block_ids("c") == [3, 2]  # then a's deepest block
    assert kv.pool.num_cached_blocks == 2
    hits, num_hit = kv.get_computed_blocks(prompt, [])
    assert [b.block_id for b in hits] == [0, 1] and num_hit == 8
    # the hits are free blocks themselves: 2 hits + 2 new blocks do not fit in 2 free blocks
    assert kv.allocate_slots("d", 13, hits) is None
    assert kv.block_ids("d") == [] and kv.num_free_blocks == 2 and kv.pool.num_cached_blocks == 2
    kv.free("b")
    assert kv.allocate_slots("d", 13, hits) == [0, 1, 5, 4] and kv.block_ids("d") == [0, 1, 5, 4]
    assert kv.num_free_blocks == 0


def test_hash_collision_is_caught_by_comparing_tokens():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, 12345, (1, 2, 3, 4))
    assert pool.lookup(12345, (1, 2, 3, 4)) is block
    assert pool.lookup(12345, (1, 2, 3, 5)) is None


def test_salts_isolate_tenants_and_caching_can_be_off():
    kv = KVCacheManager(10, BS)
    prompt = list(range(9))
    admit(kv, "a", prompt, salt="tenant-a")
    _, hit_other = admit(kv, "b", prompt, salt="tenant-b")
    _, hit_same = admit(kv, "c", prompt, salt="tenant-a")
    assert hit_other == 0 and hit_same == 8
    off = KVCacheManager(10, BS, enable_prefix_caching=False)
    admit(off, "a", prompt)
    assert admit(off, "b", prompt)[1] == 0 and off.pool.num_cached_blocks == 0
