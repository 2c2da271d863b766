"""Sliding-window attention on both backends equals dense attention under transformers' sliding-window causal mask
(a query at position p attends the keys at p - W < k <= p), computed in float32 on what the cache holds: decodes
below, at and past the window in one step, a fresh prompt longer than the window, a continued chunk whose context
is longer than it; window 0 leaves every result as it was."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import load_cpu_kernels
from llmserve.kv_cache.kv_quant import QUANTIZED_KV_DTYPES, dequantize_rows, quantize_rows
from llmserve.layers.attention import (
    AttentionMetadata,
    NativeAttention,
    TorchAttention,
    attention_metadata,
    cache_slots,
    write_rows,
)

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64
WINDOW = 24


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _backend(name):
    return NativeAttention() if name == "native" else TorchAttention()


class Step:
    """Requests with `contexts[i]` tokens in a paged cache and `counts[i]` new ones this step (decodes first, by
    context), laid out and indexed as the model runner does it; the whole K/V kept dense for the reference."""

    def __init__(self, backend, contexts, counts, block_size, dtype, kv_cache_dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.backend, self.contexts, self.counts, self.dtype = backend, contexts, counts, dtype
        totals = [c + n for c, n in zip(contexts, counts, strict=True)]
        self.keys = [torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for t in totals]
        self.values = [torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for t in totals]
        self.q = torch.randn(sum(counts), HEADS, HEAD_DIM, generator=gen).to(dtype)
        spec = backend.kv_cache_spec(1, KV_HEADS, HEAD_DIM, block_size, dtype, kv_cache_dtype)
        num_blocks = sum(-(-t // block_size) for t in totals) + 4
        self.k_cache, self.v_cache = (torch.zeros(spec.shape(num_blocks), dtype=spec.dtype) for _ in range(2))
        ids = iter(torch.randperm(num_blocks, generator=gen).tolist())
        self.tables = [[next(ids) for _ in range(-(-t // block_size))] for t in totals]
        for table, context, k, v in zip(self.tables, contexts, self.keys, self.values, strict=True):
            if context:  # the context computed in earlier steps
                positions = torch.arange(context)
                slots = cache_slots(torch.tensor(table)[positions // block_size], positions, block_size, KV_HEADS)
                write_rows(self.k_cache, slots.flatten(), k[:context])
                write_rows(self.v_cache, slots.flatten(), v[:context])
        self.block_size = block_size

    def meta(self) -> AttentionMetadata:
        counts, starts = self.counts, self.contexts
        if all(n == 1 for n in counts):
            row_of_token, first_token, positions = None, list(range(len(counts))), torch.tensor(starts)
        else:
            counts_t, starts_t = torch.tensor(counts), torch.tensor(starts)
            row_of_token = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
            first_t = torch.cumsum(counts_t, 0) - counts_t
            positions = torch.arange(sum(counts)) - first_t[row_of_token] + starts_t[row_of_token]
            first_token = first_t.tolist()
        return attention_metadata(self.backend, self.tables, row_of_token, positions, counts, starts, first_token,
                                  self.block_size, KV_HEADS, HEADS, self.dtype, torch.device("cpu"))

    def attend(self, window, meta=None, layers=1) -> torch.Tensor:
        """The backend's attention for this step (on fresh copies of the caches, `layers` times on one metadata)."""
        meta = meta or self.meta()
        new_k = torch.cat([k[c:] for k, c in zip(self.keys, self.contexts, strict=True)])
        new_v = torch.cat([v[c:] for v, c in zip(self.values, self.contexts, strict=True)])
        outs = []
        for _ in range(layers):
            k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
            outs.append(self.backend.forward(self.q, new_k, new_v, k_cache, v_cache, meta, HEAD_DIM**-0.5,
                                             window))
        return outs[0] if layers == 1 else outs

    def reference(self, window) -> torch.Tensor:
        """Dense float32 attention over what the cache holds (a fresh prompt attends its own K/V as computed),
        under an explicit (banded) causal mask."""
        quantized = self.k_cache.dtype in QUANTIZED_KV_DTYPES.values()
        outs, first = [], 0
        for k, v, context, n in zip(self.keys, self.values, self.contexts, self.counts, strict=True):

            def held(x, from_cache=context > 0):
                if quantized and from_cache:
                    return dequantize_rows(quantize_rows(x, self.k_cache.dtype), torch.float32)
                return x.float()

            query = torch.arange(context, context + n).unsqueeze(1)
            key = torch.arange(context + n)
            mask = key <= query
            if window:
                mask &= key > query - window
            q = self.q[first : first + n].float().transpose(0, 1)  # [heads, n, D]
            ks = held(k).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
            vs = held(v).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
            scores = (q @ ks.transpose(1, 2) * HEAD_DIM**-0.5).masked_fill(~mask, float("-inf"))
            outs.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
            first += n
        return torch.cat(outs)


# contexts (new token included) below, at and past the window, and far past it, across blocks
DECODE_CONTEXTS = [3, WINDOW - 1, WINDOW, WINDOW + 1, 40, 77, 300]
CASES = {
    "decodes": ([c - 1 for c in DECODE_CONTEXTS], [1] * len(DECODE_CONTEXTS)),
    "fresh prompt": ([0], [3 * WINDOW + 5]),
    "continued chunk": ([70], [20]),
    "mixed": ([4, WINDOW - 1, 90, 0, 0, 37], [1, 1, 1, 2 * WINDOW + 3, 9, 30]),
}
# float32 throughout on a model-dtype cache; a 1-byte cache's int8 kernel rounds the query and probabilities to
# ~15 bits (tests/kernels/test_paged_attention_quantized.py)
TOLERANCE = {"auto": 2e-5, "int8": 3e-4, "fp8_e4m3": 3e-4}


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_windowed_attention_equals_dense_banded_reference(backend, kv_cache_dtype, block_size, case):
    contexts, counts = CASES[case]
    step = Step(_backend(backend), contexts, counts, block_size, torch.float32, kv_cache_dtype)
    tol = TOLERANCE[kv_cache_dtype]
    torch.testing.assert_close(step.attend(WINDOW), step.reference(WINDOW), atol=tol, rtol=tol)
    # and the same step unwindowed: the full causal reference, which differs from the windowed one
    full = step.attend(0)
    torch.testing.assert_close(full, step.reference(0), atol=tol, rtol=tol)
    assert not torch.allclose(full, step.reference(WINDOW), atol=1e-3)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("window", [1, 16, 17, 100])
def test_windows_of_any_size_on_one_mixed_step(backend, window):
    # window 1: each token attends itself only; 16 and 17: the window starts at, or one past, a block's start
    contexts, counts = CASES["mixed"]
    step = Step(_backend(backend), contexts, counts, 16, torch.float32, "auto", seed=window)
    torch.testing.assert_close(step.attend(window), step.reference(window), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_bfloat16_windowed_attention_is_as_close_as_the_full_one(backend):
    contexts, counts = CASES["mixed"]
    step = Step(_backend(backend), contexts, counts, 16, torch.bfloat16, "auto")
    windowed = (step.attend(WINDOW).float() - step.reference(WINDOW)).abs().max()
    full = (step.attend(0).float() - step.reference(0)).abs().max()
    assert windowed <= max(2 * full, 1e-2)


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("case", list(CASES))
def test_window_zero_is_the_full_attention_bit_for_bit(backend, kv_cache_dtype, case):
    # 0 (the default) and a window no context reaches take today's path: the same bits as a call without a window
    contexts, counts = CASES[case]
    step = Step(_backend(backend), contexts, counts, 16, torch.float32, kv_cache_dtype)
    meta = step.meta()
    new_k = torch.cat([k[c:] for k, c in zip(step.keys, step.contexts, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(step.values, step.contexts, strict=True)])
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    default = step.backend.forward(step.q, new_k, new_v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert torch.equal(step.attend(0, meta), default)
    assert torch.equal(step.attend(10_000, meta), default)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_windowed_and_full_layers_share_one_steps_metadata(backend):
    # Gemma 3 interleaves windowed layers with full ones on one metadata: each window's masks are built once per
    # step and kept on it, and the full layers' results stay as they were
    contexts, counts = CASES["mixed"]
    step = Step(_backend(backend), contexts, counts, 16, torch.float32, "auto")
    meta = step.meta()
    full = step.attend(0, meta)
    windowed = step.attend(WINDOW, meta, layers=2)
    assert torch.equal(windowed[0], windowed[1])
    assert meta.windowed(WINDOW, 16) is meta.windowed(WINDOW, 16)
    assert list(meta._windows) == [WINDOW]
    other = step.attend(WINDOW + 8, meta)
    assert sorted(meta._windows) == [WINDOW, WINDOW + 8]
    assert torch.equal(step.attend(0, meta), full)
    torch.testing.assert_close(windowed[0], step.reference(WINDOW), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(other, step.reference(WINDOW + 8), atol=2e-5, rtol=2e-5)


def test_a_continued_chunk_gathers_only_the_blocks_its_windows_reach():
    step = Step(TorchAttention(), [70], [20], 16, torch.float32, "auto")
    span = step.meta().windowed(WINDOW, 16).prefills[0]
    # the chunk's first query, at position 70, sees from 47 on: blocks 2.. (positions 32..89)
    assert span.context_len == 90 - 32
    assert span.context_rows.numel() == KV_HEADS * 4
    assert span.mask.shape == (20, 90 - 32)


@pytest.mark.compile
def test_a_windowed_native_decode_step_compiles_into_one_graph():
    # the window is a constant of each layer's call: a decode-only step stays two custom ops in one graph
    step = Step(NativeAttention(), [c - 1 for c in DECODE_CONTEXTS], [1] * len(DECODE_CONTEXTS), 16, torch.float32,
                "auto")
    meta = step.meta()
    new_k = torch.stack([k[c] for k, c in zip(step.keys, step.contexts, strict=True)])
    new_v = torch.stack([v[c] for v, c in zip(step.values, step.contexts, strict=True)])

    def layers(q, k_cache, v_cache):
        windowed = step.backend.forward(q, new_k, new_v, k_cache, v_cache, meta, HEAD_DIM**-0.5, WINDOW)
        return windowed, step.backend.forward(q, new_k, new_v, k_cache, v_cache, meta, HEAD_DIM**-0.5)

    compiled = torch.compile(layers, fullgraph=True)
    windowed, full = compiled(step.q, step.k_cache.clone(), step.v_cache.clone())
    assert torch.equal(windowed, step.attend(WINDOW, meta)) and torch.equal(full, step.attend(0, meta))
