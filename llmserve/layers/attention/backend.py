"""What an attention backend is: the cache it declares, the decodes' metadata it builds once a step, the attention it
runs per layer, and whether it can run here (`unavailable`); and the prompt chunks' attention both backends share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.kv_cache.kv_cache_spec import KVCacheSpec
from llmserve.kv_cache.kv_quant import QUANTIZED_KV_DTYPES
from llmserve.layers.attention.metadata import AttentionMetadata, DecodeBatch, DecodeGroup, PrefillSpan, gather_rows


class AttentionBackend:
    """How attention runs over the paged cache: the decodes' metadata the runner builds for it (once per
    step, shared by every layer), and the layer's attention. Chosen once, by the build plan; every layer
    holds the same one."""

    # whether `decode_metadata` reads `head_rows` (each request's (block, KV head) rows): built only for those that do
    gathers_head_rows = True
    # every prompt token attends as a decode row of its own (`attention_metadata`), so that a query's result does
    # not depend on how its prompt was chunked or cached, or on the rest of its step (a backend whose decode path
    # is batch-invariant sets it; see NativeAttention.take_prompt_tokens_as_decodes)
    prompt_tokens_as_decodes = False

    @classmethod
    def unavailable(cls, device: str, native_kernels: bool) -> str | None:
        """Why this backend cannot run on `device` (with llmserve's native CPU kernels built, or not), or None where
        it can: the build plan takes the first registered backend that can, and logs why it passed the others."""
        return None

    def kv_cache_spec(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                      dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVCacheSpec:
        """The cache this backend reads and writes: the layout above, in the model dtype (`kv_cache_dtype`
        auto) or as 1-byte rows with their scales (int8, fp8_e4m3: kv_cache/kv_quant.py). Both backends
        here read every format."""
        stored = dtype if kv_cache_dtype == "auto" else QUANTIZED_KV_DTYPES[kv_cache_dtype]
        return KVCacheSpec(num_layers, num_kv_heads, head_dim, block_size, stored)

    def decode_metadata(self, tables: list[list[int]], head_rows: torch.Tensor | None, context_starts: list[int],
                        block_size: int, num_heads: int, dtype: torch.dtype,
                        device: torch.device) -> DecodeBatch | list[DecodeGroup]:
        """The decodes' part of a step's metadata. tables: the decodes' block tables (sorted by context), head_rows
        (where `gathers_head_rows`) the step's rows of the (block, kv head) cache view [rows, kv_heads, max_blocks],
        decodes first; context_starts the decodes' computed tokens."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend. q [T, heads, head_dim], k and v
        [T, kv_heads, head_dim]; returns [T, heads, head_dim].

        `window` 0: causal attention over the whole context. `window` W > 0: sliding-window attention as
        transformers masks it for Mistral and Gemma 3's sliding layers (masking_utils'
        sliding_window_causal_mask_function: `kv_idx > q_idx - W` and `kv_idx <= q_idx`): the query at position p
        attends the keys at positions k with p - W < k <= p, its last W positions, itself included."""
        raise NotImplementedError

    def stay_eager_in_compiled_graphs(self) -> None:
        """Before torch.compile traces a model holding this backend: the Python it should not trace (a loop over
        a step's groups and spans, re-traced for every batch shape) becomes an opaque eager call in the graph.
        Done here, when a graph is about to be compiled, rather than by decorators at import: those import
        torch._dynamo (a cost to every start, on a plan that compiles nothing; docs/performance.md, "Start-up") and
        put its wrapper on every eager call."""
        self.forward = torch.compiler.disable(self.forward)


def prefills_into(out, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> None:
    for span in meta.prefills:
        out[span.start : span.end] = prefill_attention(q, k, v, k_cache, v_cache, span, scale)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if span.context_rows is None:
        ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q, D]
        vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
    else:
        num_kv_heads, head_dim = k_cache.shape[1], q.shape[2]
        ks = gather_rows(k_cache, span.context_rows, q.dtype).view(1, num_kv_heads, -1, head_dim)
        vs = gather_rows(v_cache, span.context_rows, q.dtype).view(1, num_kv_heads, -1, head_dim)
        ks, vs = ks[:, :, : span.context_len], vs[:, :, : span.context_len]
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)
