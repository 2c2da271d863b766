"""Memory straight from the kernel: an anonymous private mapping, seen as a CPU tensor.

Why: unlike the allocator's memory, its pages are zeros mapped on first touch (a KV cache sized for the whole budget
costs nothing until its blocks are used: kv_cache/kv_cache_spec.py), and the mapping can be advised as a whole
(huge pages for the weights a step streams: quantization/weight_arena.py).
"""

from __future__ import annotations

import mmap

import torch


def anonymous_pages(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """uint8 [nbytes] of zeros, resident only where written. `huge_pages`: advised MADV_HUGEPAGE (OSError where the
    mapping or the advice is refused). Private: a shared anonymous mapping is shmem, whose huge pages follow another
    setting, and a forked child would write into it."""
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages:
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8)  # holds a reference to the mapping: it lives as long as a view
