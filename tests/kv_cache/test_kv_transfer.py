"""A prompt's KV blocks from one engine into another's prefix cache: the receiver then computes only the prompt's
last partial block and gives the sender's greedy tokens; blocks it already holds are kept, a pool that runs out
takes the leading run, and bytes of another format or not whole blocks are refused with nothing changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.kv_cache.block_hash import extend_block_hashes
from llmserve.kv_cache.block_pool import BlockPool
from llmserve.kv_cache.kv_transfer import KVFormat, KVFormatError, export_blocks, import_blocks
from tests.quantization.tiny_models import make_tiny_hf_dir

FMT = KVFormat(model="m", weights="as loaded", dtype="float32", block_size=4, num_layers=2, num_kv_heads=1,
               row_width=3)


def _caches(num_blocks: int, fill: float | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, FMT.num_kv_heads, FMT.block_size, FMT.row_width)
    make = (lambda: torch.rand(shape)) if fill is None else (lambda: torch.full(shape, fill))
    return [(make(), make()) for _ in range(FMT.num_layers)]


def _sent(num_blocks: int, tokens: list[int]) -> tuple[BlockPool, list, list[bytes], int, bytes]:
    """A sender whose pool caches the first `num_blocks` blocks of `tokens`, and what it exports for them."""
    pool, caches = BlockPool(16), _caches(16)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, FMT.block_size)
    blocks = pool.allocate(num_blocks)
    for i, block in enumerate(blocks):
        pool.cache(block, hashes[i], tuple(tokens[i * 4:(i + 1) * 4]))
    pool.free(blocks)
    count, payload = export_blocks(pool, caches, hashes, tokens, FMT.block_size)
    return pool, caches, hashes, count, payload


def test_blocks_land_in_the_receivers_cache_free_and_findable():
    tokens = list(range(100, 124))  # six blocks of 4; the sender holds the first five
    sender_pool, sender_caches, hashes, count, payload = _sent(5, tokens)
    assert count == 5 and len(payload) == 5 * FMT.bytes_per_block
    pool, caches = BlockPool(8), _caches(8, fill=0.0)
    assert import_blocks(pool, caches, FMT, FMT, count, payload, hashes, tokens) == 5
    assert pool.num_free_blocks == 8  # nothing taken: free, and found by hash
    for i in range(5):
        mine = pool.lookup(hashes[i], tuple(tokens[i * 4:(i + 1) * 4]))
        theirs = sender_pool.lookup(hashes[i], tuple(tokens[i * 4:(i + 1) * 4]))
        for (k, v), (k0, v0) in zip(caches, sender_caches, strict=True):
            assert torch.equal(k[mine.block_id], k0[theirs.block_id])
            assert torch.equal(v[mine.block_id], v0[theirs.block_id])
    # a token that differs from the block's (a hash collision) is not sent
    assert export_blocks(sender_pool, sender_caches, hashes, [0, *tokens[1:]], FMT.block_size)[0] == 0


def test_held_blocks_are_kept_and_a_full_pool_takes_the_leading_run():
    tokens = list(range(24))
    _, _, hashes, count, payload = _sent(5, tokens)
    pool, caches = BlockPool(4), _caches(4, fill=7.0)
    held = pool.allocate(1)[0]
    pool.cache(held, hashes[0], tuple(tokens[:4]))
    pool.free([held])
    # four blocks in the pool: the one held here, and room for three of the four it lacks
    assert import_blocks(pool, caches, FMT, FMT, count, payload, hashes, tokens) == 3
    assert pool.lookup(hashes[0], tuple(tokens[:4])) is held and torch.all(caches[0][0][held.block_id] == 7.0)
    found = [pool.lookup(h, tuple(tokens[i * 4:(i + 1) * 4])) is not None for i, h in enumerate(hashes[:5])]
    assert found == [True, True, True, True, False]
    assert pool.num_free_blocks == 4


@pytest.mark.parametrize(("sent", "cut", "needle"), [
    (dataclasses.replace(FMT, block_size=8), 0, "block_size 8 (here 4)"),
    (dataclasses.replace(FMT, model="other", dtype="bfloat16"), 0, "model 'other' (here 'm'), dtype"),
    (FMT, 1, "bytes sent for 5 blocks"),
])
def test_another_format_or_a_cut_payload_is_refused_and_changes_nothing(sent, cut, needle):
    tokens = list(range(24))
    _, _, hashes, count, payload = _sent(5, tokens)
    pool, caches = BlockPool(8), _caches(8, fill=0.0)
    with pytest.raises(KVFormatError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        import_blocks(pool, caches, FMT, sent, count, payload[:len(payload) - cut], hashes, tokens)
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 0
    assert all(torch.all(k == 0) and torch.all(v == 0) for k, v in caches)


def test_an_engine_continues_from_another_engines_blocks(tmp_path):
    tiny = str(make_tiny_hf_dir(tmp_path, "qwen2", kv_heads=2))
    options = dict(dtype="float32", kv_cache_memory_gb=0.02, max_model_len=512, quantization="none")
    sender, receiver = LLM(tiny, **options), LLM(tiny, **options)
    ids = sender.engine.processor.encode(" ".join(f"Item {i}: the quick brown fox." for i in range(10)))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = sender.generate([ids], params, use_tqdm=False)
    hashes = sender.engine.prompt_block_hashes(ids)
    count, payload = sender.engine.export_kv(hashes, ids)
    assert count == len(hashes) == (len(ids) - 1) // 16
    assert receiver.engine.import_kv(sender.engine.kv_format, count, payload, hashes, ids) == count
    [out] = receiver.generate([ids], params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    stats = receiver.engine.stats()
    assert stats.prefix_cache_hits == 16 * count
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
