"""The weights a decode step streams, moved into one arena on transparent huge pages, in the order it reads them.

Why: a one-token step reads every quantized weight once (SmolLM2: 95 MB in 121 tensors, 0.2-1.1 MB each;
Qwen2.5-Coder-1.5B: 1.0 GB). On the allocator's 4 KiB pages each page crossed is a TLB miss, the hardware
prefetcher stops at every page edge, and a tensor under 2 MiB never gets a huge page even where the kernel would
give one. In one 2 MiB-aligned arena advised MADV_HUGEPAGE, a step's products walk ~46 (SmolLM2) to ~480 (the 1.5B)
huge pages in address order (docs/performance.md, "Quantized weight kernels"). The values are copied bit for bit:
the products read the same bytes at another address.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch import nn

from llmserve.engine.heap import trim_heap
from llmserve.os_pages import MADV_POPULATE_WRITE, advise_storages, anonymous_pages

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line, as the allocator's do
# the heap's freed pages handed back after each this many bytes copied: the originals lie among other chunks, where
# glibc keeps them resident (engine/heap.py), and the arena would otherwise add all of them to the start's peak
_TRIM_EVERY = 64 << 20
_POPULATE_CHUNK = HUGE_PAGE  # the memory-map lock held for a few ms at a time (os_pages.advise_storages)


def streamed_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, buffer name) of every quantized linear's packed weight and scales, in module order: the decoder
    layers in turn (each its q/k/v, o, gate/up and down), then the output head, as a step reads them."""
    return [(module, name) for module in model.modules() for name in ("qweight", "scales")
            if isinstance(getattr(module, "qweight", None), torch.Tensor)
            and isinstance(module._buffers.get(name), torch.Tensor)]


def place_on_huge_pages(model: nn.Module) -> int:
    """Copy the streamed weights into one anonymous private mapping advised MADV_HUGEPAGE and make each buffer a
    view of it (the arena lives as long as any view does); returns the bytes placed. Each original is released
    as its copy is made and the heap trimmed every `_TRIM_EVERY` bytes, so memory grows by that much at most. Raises
    OSError, before any buffer has moved, where the mapping or the advice is refused."""
    entries = streamed_weights(model)
    return _move_into(_arena(entries), entries)


class ArenaInBackground:
    """The arena made ready beside serving, for a model mapped from a file (quantization/prepared_cache.py): the
    mapped weights serve at once, while a thread faults the arena's huge pages (1.3-4 s a GB on a Zen 4 cloud host,
    against ~0.2 s for small pages: most of a mapped start's time). `move` then copies the weights in between two
    steps (~0.1 s a GB, more for file pages not read yet). The file's pages stay resident beside the arena until the
    caller drops them, as they would during a copy at start."""

    def __init__(self, model: nn.Module, mapped: list[torch.UntypedStorage]) -> None:
        self.entries = streamed_weights(model)
        self.mapped = mapped
        self._arena: torch.Tensor | None = None
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._prepare, name="llmserve-weight-arena", daemon=True)
        self._thread.start()

    def _prepare(self) -> None:
        # at the lowest priority: faulting huge pages is kernel time that would otherwise take a core from the start
        # and from the steps (two such threads on a 2-core host left the start a third of a core)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            arena = _arena(self.entries)
            # every huge page faulted here, not during the copy between steps (by the kernel: no torch threads beside
            # the step's; where refused, the copy faults them)
            advise_storages([arena.untyped_storage()], MADV_POPULATE_WRITE, chunk=_POPULATE_CHUNK)
            self._arena = arena
        except OSError as e:
            self._error = e

    @property
    def ready(self) -> bool:
        return not self._thread.is_alive()

    def move(self) -> int:
        """Place the weights in the prepared arena (call between steps, once `ready`); returns the bytes placed.
        Raises the OSError that refused the arena, with no buffer moved."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        arena, self._arena = self._arena, None
        return _move_into(arena, self.entries)


def _arena(entries: list[tuple[nn.Module, str]]) -> torch.Tensor:
    """A mapping advised MADV_HUGEPAGE that holds `entries` from a huge-page boundary on (OSError where refused)."""
    total = _aligned(sum(_aligned(getattr(module, name).nbytes, _ALIGN) for module, name in entries), HUGE_PAGE)
    return anonymous_pages(total + HUGE_PAGE, huge_pages=True)


def _move_into(arena: torch.Tensor, entries: list[tuple[nn.Module, str]]) -> int:
    offset = -arena.data_ptr() % HUGE_PAGE
    since_trim = placed = 0
    for module, name in entries:
        tensor = module._buffers[name]
        view = arena[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        module._buffers[name] = view
        del tensor
        size = _aligned(view.nbytes, _ALIGN)
        offset += size
        placed += size
        since_trim += size
        if since_trim >= _TRIM_EVERY:
            trim_heap()
            since_trim = 0
    return placed


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to
