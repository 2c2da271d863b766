"""The native kernels equal the PyTorch path on the same inputs (the fallback they replace)."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch

from llmserve.host import cpu_flags
from llmserve.kernels import build_directory, load_cpu_kernels
from llmserve.layers.attention import DecodeGroup
from llmserve.layers.attention.torch_ops import _decode_attention


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _paged_case(batch, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, max_blocks=12):
    """Random caches; requests share a prefix of blocks (as prefix caching makes them) and end anywhere."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 200 + batch * max_blocks
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    context = torch.randint(1, max_blocks * block_size, (batch,), generator=gen).sort().values
    shared = [1, 2]
    fresh = iter(torch.randperm(num_blocks - 3, generator=gen).add(3).tolist())
    tables = [(shared + [next(fresh) for _ in range(max_blocks)])[: -(-int(c) // block_size)] for c in context]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return q, k_cache, v_cache, block_table, context.to(torch.int32)


def _torch_path(q, k_cache, v_cache, block_table, context, scale, window=0):
    """The engine's PyTorch decode attention on the same request, one request per group; `window` > 0: its last
    `window` tokens only (an explicit banded bias)."""
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        blocks = -(-int(context[b]) // block_size)
        rows = (block_table[b, :blocks].long().unsqueeze(0) * num_kv_heads + torch.arange(num_kv_heads).view(-1, 1))
        bias = torch.zeros(1, num_heads, blocks * block_size, dtype=q.dtype)
        bias[..., int(context[b]) :] = float("-inf")
        if window:
            bias[..., : max(0, int(context[b]) - window)] = float("-inf")
        out[b : b + 1] = _decode_attention(q[b : b + 1], k_cache, v_cache, DecodeGroup(b, b + 1, rows.flatten(), bias),
                                           scale)
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 2, 48)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_attention_equals_torch_path_float32(num_heads, num_kv_heads, head_dim, block_size):
    q, k_cache, v_cache, table, context = _paged_case(7, num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    scale = head_dim**-0.5
    out = torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, table, context, scale)
    torch.testing.assert_close(out, _torch_path(q, k_cache, v_cache, table, context, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 48)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_attention_bfloat16_is_as_close_to_float32_as_the_torch_path(
    num_heads, num_kv_heads, head_dim, block_size
):
    # bf16 (the AVX512-BF16 path where the CPU has it; head_dim 48 takes the generic one): against the float32
    # result on the same bf16 inputs, no worse than the PyTorch bf16 path is
    q, k_cache, v_cache, table, context = _paged_case(9, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16)
    scale = head_dim**-0.5
    exact = torch.ops.llmserve.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, context,
                                                     scale)
    ours = torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, table, context, scale).float()
    theirs = _torch_path(q, k_cache, v_cache, table, context, scale).float()
    assert (ours - exact).abs().max() <= max(2 * (theirs - exact).abs().max(), 1e-2)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("block_size", [16, 5])
def test_few_long_contexts_split_across_threads_stay_as_close(batch, block_size):
    # one or two requests give fewer (request, KV head) tasks than threads: their contexts are split into
    # parts whose softmax statistics are merged; the result must be as good as in one piece
    q, k_cache, v_cache, table, context = _paged_case(batch, 9, 3, 64, block_size, torch.bfloat16, seed=batch,
                                                      max_blocks=40 * 16 // block_size)
    assert int(context.max()) > 128  # long enough to be split
    scale = 64**-0.5
    exact = torch.ops.llmserve.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, context,
                                                     scale)
    ours = torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, table, context, scale).float()
    theirs = _torch_path(q, k_cache, v_cache, table, context, scale).float()
    assert (ours - exact).abs().max() <= max(2 * (theirs - exact).abs().max(), 1e-2)
    torch.testing.assert_close(exact, _torch_path(q.float(), k_cache.float(), v_cache.float(), table, context, scale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("context_len", [70, 150, 600])
def test_one_context_split_into_parts_is_as_close_on_any_thread_count(dtype, threads, context_len):
    # one request's context in 2-6 parts of >= 64 tokens, as many as a multiple of the threads where it is long
    # enough (then run interleaved: thread t takes parts t, t + threads, ...), else claimed one by one. The parts'
    # results are not zeroed first: one never computed would show as garbage here.
    q, k_cache, v_cache, _, _ = _paged_case(1, 9, 3, 64, 16, dtype, seed=context_len, max_blocks=40)
    gen = torch.Generator().manual_seed(context_len)
    table = torch.randperm(k_cache.shape[0], generator=gen)[: -(-context_len // 16)].to(torch.int32).unsqueeze(0)
    context = torch.tensor([context_len], dtype=torch.int32)
    scale = 64**-0.5
    exact = torch.ops.llmserve.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, context,
                                                     scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, table, context, scale).float()
    finally:
        torch.set_num_threads(before)
    theirs = _torch_path(q, k_cache, v_cache, table, context, scale).float()
    if dtype == torch.float32:  # float32 throughout: the parts' merge changes only the sums' order
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert (ours - exact).abs().max() <= max(2 * (theirs - exact).abs().max(), 1e-2)


def _laid_out(k, v, block_size, cache_dtype, gen):
    """k, v [tokens, kv_heads, head_dim] in caches of `block_size`-token blocks at shuffled block ids (written by
    write_kv, which quantizes for a 1-byte cache), and the block table that reads them back in order"""
    from llmserve.kv_cache.kv_quant import row_width

    tokens, kv_heads, head_dim = k.shape
    blocks = -(-tokens // block_size)
    ids = torch.randperm(blocks + 8, generator=gen)[:blocks]
    k_cache = torch.zeros(blocks + 8, kv_heads, block_size, row_width(head_dim, cache_dtype), dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    position = torch.arange(tokens)
    slots = ((ids[position // block_size] * kv_heads).view(-1, 1) + torch.arange(kv_heads)) * block_size
    torch.ops.llmserve.write_kv(k, v, k_cache, v_cache, (slots + (position % block_size).view(-1, 1)).flatten())
    return k_cache, v_cache, ids.to(torch.int32).unsqueeze(0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("context_len", [7, 70, 600])
def test_a_context_gives_the_same_bits_in_blocks_of_any_size(cache_dtype, threads, context_len):
    # 16 tokens inside one block are read as one run of rows (RowWalker.run: blocks of 16 or 32), else row by row
    # through the table (blocks of 5): the same values in the same order either way, so the same bits. Except a bf16
    # cache on an AMX CPU: blocks of a multiple of 16 tokens score and sum on AMX tiles, whose bf16 dot products round
    # apart from vdpbf16ps's, and blocks of 5 on the vector loops; an engine's one block size keeps one path
    gen = torch.Generator().manual_seed(context_len)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    k, v = (torch.randn(context_len, 3, 64, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, 9, 64, generator=gen).to(dtype)
    lens = torch.tensor([context_len], dtype=torch.int32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = [torch.ops.llmserve.paged_decode_attention(q, *_laid_out(k, v, size, cache_dtype, gen), lens, 0.125)
                for size in (5, 16, 32)]
    finally:
        torch.set_num_threads(before)
    assert outs[0].isfinite().all()
    assert torch.equal(outs[1], outs[2])
    if cache_dtype == torch.bfloat16 and {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags():
        torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=2e-2)
    else:
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 48)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [1, 15, 16, 17, 50])
def test_windowed_decode_equals_torch_path_float32(num_heads, num_kv_heads, head_dim, block_size, window):
    # sliding-window attention: each request's last `window` tokens (contexts from 1 to 12 blocks, below and past it)
    q, k_cache, v_cache, table, context = _paged_case(7, num_heads, num_kv_heads, head_dim, block_size, torch.float32,
                                                      seed=window)
    scale = head_dim**-0.5
    out = torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, table, context, scale, window)
    torch.testing.assert_close(out, _torch_path(q, k_cache, v_cache, table, context, scale, window), atol=1e-5,
                               rtol=1e-5)
    if int(context.max()) > window:  # some context is cut by the window: not the full attention
        assert not torch.allclose(out, _torch_path(q, k_cache, v_cache, table, context, scale), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("window", [40, 100, 333, 1000])
@pytest.mark.parametrize("block_size", [16, 5])
def test_windowed_contexts_split_into_parts_stay_as_close(dtype, threads, window, block_size):
    # one long request (fewer (request, KV head) tasks than 2 threads): its window (from any token, read from a
    # multiple of 16 within its block) is split into parts across threads; the tokens read before the window must
    # weigh nothing in any part
    q, k_cache, v_cache, _, _ = _paged_case(1, 9, 3, 64, block_size, dtype, seed=window, max_blocks=800 // block_size)
    gen = torch.Generator().manual_seed(window)
    table = torch.randperm(k_cache.shape[0], generator=gen)[: -(-777 // block_size)].to(torch.int32).unsqueeze(0)
    context = torch.tensor([777], dtype=torch.int32)
    scale = 64**-0.5
    exact = torch.ops.llmserve.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, context,
                                                     scale, window)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, table, context, scale, window).float()
    finally:
        torch.set_num_threads(before)
    theirs = _torch_path(q, k_cache, v_cache, table, context, scale, window).float()
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert (ours - exact).abs().max() <= max(2 * (theirs - exact).abs().max(), 1e-2)
    torch.testing.assert_close(exact, _torch_path(q.float(), k_cache.float(), v_cache.float(), table, context, scale,
                                                  window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 5])
def test_blocks_before_the_window_are_never_read(cache_dtype, block_size):
    # blocks that left the window may be freed: their table entries may be anything, even out of range
    gen = torch.Generator().manual_seed(block_size)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    k, v = (torch.randn(300, 3, 64, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, 9, 64, generator=gen).to(dtype)
    lens = torch.tensor([300], dtype=torch.int32)
    k_cache, v_cache, table = _laid_out(k, v, block_size, cache_dtype, gen)
    window = 70
    out = torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125, window)
    freed = table.clone()
    freed[0, : (300 - window) // block_size] = -1  # every block before the one holding the window's first token
    assert torch.equal(torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, freed, lens, 0.125, window),
                       out)
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, freed, lens, 0.125)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_window_zero_or_past_the_context_is_the_full_attention_bit_for_bit(cache_dtype):
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    k, v = (torch.randn(600, 3, 64, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, 9, 64, generator=gen).to(dtype)
    lens = torch.tensor([600], dtype=torch.int32)
    caches = _laid_out(k, v, 16, cache_dtype, gen)
    full = torch.ops.llmserve.paged_decode_attention(q, *caches, lens, 0.125)
    for window in (0, 600, 10_000):
        assert torch.equal(torch.ops.llmserve.paged_decode_attention(q, *caches, lens, 0.125, window), full)
    assert torch.equal(torch.ops.llmserve.paged_decode_attention(q, *caches, lens, 0.125, window=0), full)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        torch.ops.llmserve.paged_decode_attention(q, *caches, lens, 0.125, -1)


def test_write_kv_equals_index_copy():
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(10, 3, 4, 8, generator=gen)
    k, v = torch.randn(5, 3, 8, generator=gen), torch.randn(5, 3, 8, generator=gen)
    slots = torch.randperm(cache.numel() // 8, generator=gen)[:15]
    k_ours, v_ours = cache.clone(), cache.clone()
    torch.ops.llmserve.write_kv(k, v, k_ours, v_ours, slots)
    k_ref, v_ref = cache.clone(), cache.clone()
    k_ref.view(-1, 8).index_copy_(0, slots, k.reshape(-1, 8))
    v_ref.view(-1, 8).index_copy_(0, slots, v.reshape(-1, 8))
    assert torch.equal(k_ours, k_ref) and torch.equal(v_ours, v_ref)


def test_bad_inputs_raise_without_writing():
    cache = torch.zeros(4, 1, 2, 8)
    k = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.llmserve.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 8]))
    assert not cache.any()
    q = torch.ones(1, 2, 8)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.llmserve.paged_decode_attention(q, cache, cache, torch.full((1, 1), 4, dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match="context length out of range"):
        torch.ops.llmserve.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), lens * 3, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.llmserve.paged_decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                                  torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.llmserve.paged_decode_attention(q.double(), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                                  torch.ones(1, dtype=torch.int32), 1.0)


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads x86 instructions with binutils' objdump")
@pytest.mark.parametrize("source", ["paged_attention", "paged_attention_quantized"])
def test_the_row_walker_prefetches_survive_the_compiler(source):
    """The K/V walker prefetches the blocks ahead of it; as a function of its own GCC found it free of effects
    and deleted every call, so the built kernels had no prefetch at all (1.9x slower attention over a context
    that has left the cache). The built object must hold them."""
    built = build_directory() / f"{source}.o"
    assert built.exists(), f"no {built}"
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(built)], capture_output=True, text=True,
                             check=True).stdout
    assert "prefetch" in listing
