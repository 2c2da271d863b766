"""Memory straight from the kernel: an anonymous private mapping, seen as a CPU tensor.

Why: unlike the allocator's memory, its pages are zeros mapped on first touch (a KV cache sized for the whole budget
costs nothing until its blocks are used: kv_cache/kv_cache_spec.py), and the mapping can be advised as a whole
(huge pages for the weights a step streams: quantization/weight_arena.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
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


@functools.cache
def _libc_madvise():
    try:
        madvise = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), "madvise", None)
    except OSError:
        return None
    if madvise is not None:
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


# Linux's advice values (mmap's module lacks MADV_POPULATE_READ before Python 3.12's builds on newer headers)
MADV_DONTNEED = mmap.MADV_DONTNEED
MADV_POPULATE_READ = 22  # Linux 5.14+: page tables filled in one call (elsewhere EINVAL: then pages fault as read)
MADV_POPULATE_WRITE = 23  # the same, the pages faulted as written: an anonymous mapping's allocated and zeroed


def advise_storages(storages: list[torch.UntypedStorage], advice: int) -> int:
    """madvise(`advice`) over the whole pages of each storage; returns the bytes the kernel took the advice for (0
    where the C library has no madvise). `drop_resident_pages` and `populate` below are its two uses."""
    return sum(advise_range(storage.data_ptr(), storage.nbytes(), advice) for storage in storages)


def advise_range(address: int, nbytes: int, advice: int, chunk: int | None = None) -> int:
    """madvise(`advice`) over the whole pages in [address, address + nbytes); returns the bytes advised. `chunk`: at
    most that many bytes a call, for a thread beside others: a populating call holds the process's memory-map lock,
    and every mmap or munmap (the allocator's too) waits for it."""
    madvise = _libc_madvise()
    if madvise is None:
        return 0
    page, advised = mmap.PAGESIZE, 0
    start, end = -(-address // page) * page, (address + nbytes) // page * page
    step = chunk or max(end - start, 1)
    for at in range(start, end, step):
        n = min(step, end - at)
        if madvise(at, n, advice) == 0:
            advised += n
    return advised


def populate(storages: list[torch.UntypedStorage]) -> int:
    """Map file-backed storages' pages in one call per storage (MADV_POPULATE_READ) before a pass reads them all:
    a 1 GB copy out of a mapped file otherwise takes ~250,000 page faults."""
    return advise_storages(storages, MADV_POPULATE_READ)


def drop_resident_pages(storages: list[torch.UntypedStorage]) -> int:
    """Drop the resident pages of file-mapped storages (MADV_DONTNEED): a page read again faults in from the page
    cache, with the file's bytes. For a model mapped from a file (quantization/prepared_cache.py) whose streamed
    weights were copied elsewhere: the pages the copy read would otherwise stay resident beside the copy. Only for
    storages never written since mapped (a private page written would go back to the file's bytes)."""
    return advise_storages(storages, MADV_DONTNEED)
