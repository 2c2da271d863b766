"""The native backend: decodes on llmserve's C++ kernel (kernels/paged_attention.cpp), prompt chunks on SDPA."""

from __future__ import annotations

import torch

from llmserve.layers.attention.backend import AttentionBackend, prefills_into
from llmserve.layers.attention.metadata import AttentionMetadata, DecodeBatch, padded_tables


class NativeAttention(AttentionBackend):
    """Decodes on llmserve's C++ kernel (CPU): each request's blocks read in place through its block table.

    A decode-only step is two custom ops, which torch.compile keeps inside a compiled graph; a step with
    prompt tokens runs eagerly (a graph break)."""

    gathers_head_rows = False  # the kernel walks each block table itself

    @classmethod
    def unavailable(cls, device: str, native_kernels: bool) -> str | None:
        if not device.startswith("cpu"):
            return "a CPU kernel"
        return None if native_kernels else "llmserve's native CPU kernels are off or not built here"

    def __init__(self) -> None:
        self._mixed = _native_mixed  # a step with prompt tokens

    def decode_metadata(self, tables, head_rows, context_starts, block_size, num_heads, dtype,
                        device) -> DecodeBatch:
        # The kernel's int32 table made from the lists, one op: each op counts on the caches a step's weight stream
        # leaves (a long table sliced and converted would be three). At least 2 columns: a compiled graph
        # specialises on a size of 1, and short contexts would otherwise need a variant of their own.
        return DecodeBatch(len(tables), padded_tables(tables, torch.int32, device, min_width=2),
                           torch.tensor([start + 1 for start in context_starts], dtype=torch.int32, device=device))

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window: int = 0) -> torch.Tensor:
        torch.ops.llmserve.write_kv(k, v, k_cache, v_cache, meta.write_slots)
        if not meta.prefills:
            return _native_decode(q, k_cache, v_cache, meta.decodes, scale, window)
        return self._mixed(q, k, v, k_cache, v_cache, meta, scale, window)

    def take_prompt_tokens_as_decodes(self) -> None:
        """Every prompt token a decode row on the kernel, which splits a context where the context alone decides
        (attention_common.h, `split_contexts`): a query's bits do not depend on its prompt's chunking, on cached
        blocks or on the rest of its step, as SDPA's blocking of a chunk does (the build plan's determinism)."""
        self.prompt_tokens_as_decodes = True

    def stay_eager_in_compiled_graphs(self) -> None:
        """Only a step with prompt tokens: its data-dependent Python runs eagerly (a graph break); a decode-only
        step's two custom ops stay inside the graph."""
        self._mixed = torch.compiler.disable(_native_mixed)


def _native_mixed(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """A step with prompt tokens on the native path: the decodes on the kernel, each prompt chunk on SDPA."""
    if window:
        meta = meta.windowed(window, k_cache.shape[2])
    out = torch.empty_like(q)
    if meta.decodes.size:
        out[: meta.decodes.size] = _native_decode(q[: meta.decodes.size], k_cache, v_cache, meta.decodes, scale,
                                                  window)
    prefills_into(out, q, k, v, k_cache, v_cache, meta, scale)
    return out


def _native_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch, scale: float, window: int = 0
) -> torch.Tensor:
    return torch.ops.llmserve.paged_decode_attention(q, k_cache, v_cache, batch.block_table, batch.context_lens, scale,
                                                     window)
