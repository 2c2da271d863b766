"""The weights a decode step streams, moved into one arena on transparent huge pages, in the order it reads them.

Why: a one-token step reads every quantized weight once (SmolLM2: 95 MB in 121 tensors, 0.2-1.1 MB each;
Qwen2.5-Coder-1.5B: 1.0 GB). On the allocator's 4 KiB pages each page crossed is a TLB miss, the hardware
prefetcher stops at every page edge, and a tensor under 2 MiB never gets a huge page even where the kernel would
give one. In one 2 MiB-aligned arena advised MADV_HUGEPAGE, a step's products walk ~46 (SmolLM2) to ~480 (the 1.5B)
huge pages in address order (docs/performance.md, "Quantized weight kernels"). The values are copied bit for bit:
the products read the same bytes at another address.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.engine.heap import trim_heap
from llmserve.os_pages import anonymous_pages

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line, as the allocator's do
# the heap's freed pages handed back after each this many bytes copied: the originals lie among other chunks, where
# glibc keeps them resident (engine/heap.py), and the arena would otherwise add all of them to the start's peak
_TRIM_EVERY = 64 << 20


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
    OSError, before any buffer has moved, where
    the mapping or the advice is refused."""
    entries = streamed_weights(model)
    sizes = [_aligned(getattr(module, name).nbytes, _ALIGN) for module, name in entries]
    total = _aligned(sum(sizes), HUGE_PAGE)
    arena = anonymous_pages(total + HUGE_PAGE, huge_pages=True)
    offset = -arena.data_ptr() % HUGE_PAGE
    since_trim = 0
    for (module, name), size in zip(entries, sizes, strict=True):
        tensor = module._buffers[name]
        view = arena[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        module._buffers[name] = view
        del tensor
        offset += size
        since_trim += size
        if since_trim >= _TRIM_EVERY:
            trim_heap()
            since_trim = 0
    return sum(sizes)


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to
