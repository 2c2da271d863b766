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
import ctypes
import os
import threading

import torch
from torch import nn

from llmserve.engine.heap import trim_heap
from llmserve.os_pages import MADV_POPULATE_WRITE, advise_range, anonymous_pages, drop_resident_pages

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line, as the allocator's do
# the heap's freed pages handed back after each this many bytes copied: the originals lie among other chunks, where
# glibc keeps them resident (engine/heap.py), and the arena would otherwise add all of them to the start's peak
_TRIM_EVERY = 64 << 20
_CHUNK = 16 * HUGE_PAGE  # what a background fill copies before a step may swap it in (ArenaInBackground)


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
    """The arena filled beside serving, for a model mapped from a file (quantization/prepared_cache.py): the mapped
    weights serve at once, while a thread faults the arena's huge pages (1.3-4 s a GB on a Zen 4 cloud host, against
    ~0.2 s for small pages: most of a mapped start's time) and copies the weights in, `_CHUNK` bytes at a time. Between
    two steps `swap` makes the copied ones the model's buffers. The file's pages are dropped as each part is copied
    and again once swapped (a step still reading them faults them back from the page cache), so the file and the
    arena are never both resident whole: the start's peak holds one copy of the weights, not two."""

    def __init__(self, model: nn.Module) -> None:
        self._entries = streamed_weights(model)
        self._copied: list[list[tuple[nn.Module, str, torch.Tensor]]] = []  # parts copied, not yet swapped in
        self._error: Exception | None = None
        self.placed = 0  # bytes swapped in so far
        self._thread = threading.Thread(target=self._fill, name="llmserve-weight-arena", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        # at the lowest priority, in the time the start and the steps leave: faulting huge pages is kernel time that
        # would take a core from them (two such threads on a 2-core host left the start a third of a core). Under
        # full load it may take minutes, its steps on the file's small pages meanwhile; at nice 10 it finished no
        # sooner, and the steps beside it ran slower (docs/performance.md, "Start-up")
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self._copy_in(_arena(self._entries))
        except Exception as e:  # noqa: BLE001 - the arena refused, or a copy failed: what is not swapped stays put
            self._error = e

    def _copy_in(self, arena: torch.Tensor) -> None:
        offset = start = -arena.data_ptr() % HUGE_PAGE
        part: list[tuple[nn.Module, str, torch.Tensor]] = []
        for index, (module, name) in enumerate(self._entries):
            tensor = module._buffers[name]
            part.append((module, name, arena[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)))
            offset += _aligned(tensor.nbytes, _ALIGN)
            if offset - start < _CHUNK and index < len(self._entries) - 1:
                continue
            # faulted by the kernel a huge page a call, then copied by memmove: no torch threads beside the step's
            # (where the advice is refused, the copy faults them)
            advise_range(arena.data_ptr() + start, offset - start, MADV_POPULATE_WRITE, chunk=HUGE_PAGE)
            originals = [m._buffers[n] for m, n, _ in part]
            for original, (_, _, view) in zip(originals, part, strict=True):
                source = original.contiguous()  # held through the copy
                ctypes.memmove(view.data_ptr(), source.data_ptr(), view.nbytes)
            drop_resident_pages([t.untyped_storage() for t in originals])
            self._copied.append(part)  # one reference appended: seen whole by `swap`
            part, start = [], offset

    @property
    def done(self) -> bool:
        """Every weight copied swapped in, and the fill over (see `error` for one cut short)."""
        return not self._thread.is_alive() and not self._copied

    @property
    def error(self) -> Exception | None:
        """Why the fill stopped short (the arena refused, or a copy failed): the weights not swapped stay put."""
        return self._error

    def swap(self) -> list[torch.UntypedStorage]:
        """Between steps: the weights copied since the last call become the model's buffers. Returns the storages
        they leave (the file's), to drop once nothing reads them (after the caller rebuilds what holds them)."""
        count = len(self._copied)  # the thread only appends
        parts = self._copied[:count]
        del self._copied[:count]
        left = []
        for part in parts:
            for module, name, view in part:
                left.append(module._buffers[name].untyped_storage())
                module._buffers[name] = view
                self.placed += _aligned(view.nbytes, _ALIGN)
        return left


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
