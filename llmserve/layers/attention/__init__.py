"""Attention over the paged KV cache.

KV cache layout, per layer (one tensor for K, one for V; kv_cache/kv_cache_spec.py):

    [num_blocks, num_kv_heads, block_size, head_dim]
     └─ block id                └─ offset of a token in its block

A token at position p of a request lives in block `block_table[p // block_size]` at offset
`p % block_size`. Keeping a head's tokens of a block contiguous (block_size x head_dim) means that
gathering a request's context for one KV head is a gather of whole rows of
`cache.view(num_blocks * num_kv_heads, block_size, head_dim)`: the result is already laid out
`[kv_heads, context, head_dim]`, ready for a batched matmul, with no transpose copy.

Index tensors are built once per step (`attention_metadata`, called by the model runner) and shared by
all layers. The flat token batch is ordered decodes first (one query token each, shortest context first),
then prefill chunks. Two backends, one chosen by the build plan: on CPU, `NativeAttention` sends decodes
to the C++ kernel (`llmserve/kernels/paged_attention.cpp`), which reads each request's blocks in place
through its block table: no gathered copy, no padding, one call per layer. `TorchAttention` (other
devices, or no compiler) runs decodes as padded batches with two batched matmuls each, several times
faster on CPU than SDPA for a one-token query. They are split into a few groups of similar context
length, so one long request does not pad every short one to its length (16 decodes at 200 tokens
beside one at 2,000 would otherwise gather 5x the KV they need). Each prefill chunk runs on its own
through SDPA (a step carries few of them).

Sliding-window attention (Mistral, Gemma 3's local layers) is a per-call `window`: the same step's metadata serves
windowed and full layers alike (Gemma 3 interleaves them), so each window's masks are derived from it on first use
and kept on it for the step's other layers (`AttentionMetadata.windowed`); the native kernel takes the window itself.
"""

from __future__ import annotations

from llmserve.layers.attention.backend import AttentionBackend
from llmserve.layers.attention.metadata import (
    AttentionMetadata,
    DecodeBatch,
    DecodeGroup,
    PrefillSpan,
    attention_metadata,
    cache_rows,
    cache_slots,
    padding_bias,
    write_rows,
)
from llmserve.layers.attention.native import NativeAttention
from llmserve.layers.attention.torch_ops import TorchAttention

# The backends in the order the build plan prefers them: it takes the first whose `unavailable` says nothing. A new
# backend is its module and a line here.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {"native": NativeAttention, "torch": TorchAttention}



def choose_attention(device: str, native_kernels: bool, reasons: dict[str, str]) -> str:
    """The first registered backend that can run here; where it passed others, why (under "attention")."""
    passed = []
    for name, backend in ATTENTION_BACKENDS.items():
        why = backend.unavailable(device, native_kernels)
        if why is None:
            if passed:
                reasons["attention"] = "; ".join(passed)
            return name
        passed.append(f"not {name}: {why}")
    raise RuntimeError("no attention backend can run here: " + "; ".join(passed))


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "DecodeBatch", "DecodeGroup",
           "NativeAttention", "PrefillSpan", "TorchAttention", "attention_metadata", "cache_rows", "cache_slots",
           "choose_attention", "padding_bias", "write_rows"]
