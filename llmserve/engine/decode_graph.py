"""The decode step as one compiled graph: on CPU, what CUDA graphs are to GPU servers.

A decode-only step on the native kernels traces into one graph (the kernels are custom ops inside it),
so a step is one call into Inductor's generated code instead of ~30 op dispatches per layer. Steps with
prompt tokens run eagerly: their time is in the matmuls, not in dispatch.

Dispatch: entering a compiled function through Dynamo (frame evaluation, guards over ~300 weight and cache
tensors) costs a good share of a batch-1 step (docs/performance.md, "The one-call decode step"). The compiled
variants differ only in the batch size (1, a few, more than a quantized kernel takes), so once warmed up, the
first step of each batch size goes through Dynamo, which picks or compiles the variant; that variant's code is
remembered for the size and later steps call it directly (vLLM's custom dispatcher does the same). Inputs are built
so nothing else can select a different variant: caches are static, the block table has at least 2 columns,
and sizes are never duck-shaped into equalities.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from llmserve.layers.attention import AttentionMetadata


class DecodeGraph:
    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for k_cache, v_cache in kv_caches:  # fixed for the engine's life: no symbolic sizes, no size guards
            torch._dynamo.mark_static(k_cache)
            torch._dynamo.mark_static(v_cache)
        self._model = model
        self._forward = type(model).forward
        self._compiled = torch.compile(model, dynamic=True, fullgraph=True)
        self._frozen = False
        self._by_batch: dict[int, Callable[..., torch.Tensor]] = {}

    def freeze(self) -> None:
        """Warm-up is over: from now on, remember each batch size's compiled code and call it directly."""
        self._frozen = True

    @property
    def direct_batch_sizes(self) -> set[int]:
        """Batch sizes whose compiled code is called directly."""
        return set(self._by_batch)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        direct = self._by_batch.get(len(input_ids))
        if direct is not None:
            return direct(self._model, input_ids, positions, kv_caches, meta)
        # No duck sizing: two sizes equal by chance (3 blocks in the table, 3 KV heads) must not become a
        # guard that recompiles when they differ.
        # Freezing: weights become graph constants, so Inductor prepacks each bf16 linear's weight once
        # into oneDNN's blocked layout instead of reordering it on every call (the same GEMM, bit for bit).
        # (`torch.compile(options={"freezing": True})` does not reach the compile: patch it around.)
        # Floats as constants: the model's floats (norm eps, attention scale) are fixed for its life, and traced as
        # symbols each fails Inductor's tensorify pass, which restarts the whole trace: a good share of each compile.
        with (fx_config.patch(use_duck_shape=False), inductor_config.patch(freezing=True),
              dynamo_config.patch(specialize_float=True)):
            out = self._compiled(input_ids, positions, kv_caches, meta)
        if self._frozen:
            frame = {"self": self._model, "input_ids": input_ids, "positions": positions, "kv_caches": kv_caches,
                     "meta": meta}
            for entry in _debug_get_cache_entry_list(self._forward.__code__):
                if entry.guard_manager.check(frame):  # the variant Dynamo just ran
                    self._by_batch[len(input_ids)] = types.FunctionType(entry.code, self._forward.__globals__)
                    break
        return out
