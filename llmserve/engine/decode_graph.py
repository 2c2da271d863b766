"""The decode step as one compiled graph: on CPU, what CUDA graphs are to GPU servers.

A decode-only step on the native kernels traces into one graph (the kernels are custom ops inside it),
so a step costs one guard check and one call into Inductor's generated code instead of ~30 op dispatches
per layer. Steps with prompt tokens run eagerly: their time is in the matmuls, not in dispatch.

Guards: the weights are graph inputs, and checking every tensor's guards costs ~1.3 ms a step at batch 1
(~300 tensors), a sixth of the step. Once the engine has warmed up every shape class (one sequence, a
few, more than a quantized kernel takes), `freeze()` switches to checking only the guards that tell the
compiled variants apart. A step no variant covers then raises instead of running; it is retried with
full guards, which compiles the new variant, so the worst case is a slow step, never a wrong one.
"""

from __future__ import annotations

import logging

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from llmserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

_UNCOVERED = "Recompilation triggered with skip_guard_eval_unsafe stance"


class DecodeGraph:
    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for k_cache, v_cache in kv_caches:  # fixed for the engine's life: no symbolic sizes, no size guards
            torch._dynamo.mark_static(k_cache)
            torch._dynamo.mark_static(v_cache)
        self._compiled = torch.compile(model, dynamic=True, fullgraph=True)
        self._frozen = False

    def freeze(self) -> None:
        """Every shape class has been compiled: check only the guards that pick among them."""
        self._frozen = True

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # No duck sizing: two sizes equal by chance (3 blocks in the table, 3 KV heads) must not become a
        # guard that recompiles when they differ.
        with fx_config.patch(use_duck_shape=False):
            if self._frozen:
                try:
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                        return self._compiled(input_ids, positions, kv_caches, meta)
                except RuntimeError as exc:
                    if _UNCOVERED not in str(exc):
                        raise
                    logger.warning("decode step of a shape not warmed up (batch %d): compiling it", len(input_ids))
            return self._compiled(input_ids, positions, kv_caches, meta)
