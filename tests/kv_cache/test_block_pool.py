"""Block pool and per-request block tables, with exact block ids."""

from __future__ import annotations

import pytest

from llmserve.kv_cache.block_pool import BlockPool
from llmserve.kv_cache.kv_cache_manager import KVCacheManager


def test_allocate_in_order_and_free_returns_blocks_fifo():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(1)
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2]
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.free(a)
    assert [x.block_id for x in pool.allocate(3)] == [3, 0, 1]  # freed longest ago reused first


def test_ref_counts_keep_shared_blocks_until_the_last_holder_frees():
    pool = BlockPool(2)
    [blk] = pool.allocate(1)
    blk.ref_cnt += 1  # a second holder
    pool.free([blk])
    assert pool.num_free_blocks == 1
    pool.free([blk])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free([blk])
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_manager_grows_tables_by_block_and_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate_slots("a", 5) is not None  # 2 blocks
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate_slots("a", 8) is not None  # still 2
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate_slots("a", 9) is not None
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.allocate_slots("b", 12) is None  # needs 3, 2 free
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots("b", 8) is not None
    kv.free("a")
    assert kv.num_free_blocks == 3 and kv.block_ids("a") == []
    kv.free("b")
    kv.free("never-allocated")
    assert kv.num_free_blocks == 5
