"""The CPU cache is zeros that cost nothing until used: every format reads as zeros, takes writes, and a cache
of 512 MB leaves the process's resident memory where it was until its blocks are written."""

from __future__ import annotations

import pytest
import torch

from llmserve.kv_cache.kv_cache_spec import KVCacheSpec


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_every_format_starts_as_zeros_and_takes_writes(dtype):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    caches = spec.allocate(5, "cpu")
    assert len(caches) == 2
    for k, v in caches:
        for t in (k, v):
            assert t.shape == spec.shape(5) and t.dtype == dtype and t.is_contiguous()
            assert not t.float().any()
    k0, v0 = caches[0]
    k0[3, 1].fill_(1)
    assert k0.float().sum() == 16 * spec.row_width and not v0.float().any() and not caches[1][0].float().any()


def test_a_cache_is_resident_only_where_written():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=128, block_size=16, dtype=torch.bfloat16)
    num_blocks = 512 * 2**20 // spec.bytes_per_block  # 512 MB of K and V in all
    before = _resident_bytes()
    caches = spec.allocate(num_blocks, "cpu")
    allocated = _resident_bytes()
    assert allocated - before < 32 * 2**20
    caches[0][0][: num_blocks // 2].fill_(1)  # half of one layer's K: 32 MB
    assert 24 * 2**20 < _resident_bytes() - allocated < 64 * 2**20
