"""Hand the C heap's free pages back to the system once a model is built.

Why: loading leaves gigabytes freed but resident. The float32 copies of the weights, their casts and the
quantizers' temporaries are freed once the model holds its own layout, but glibc keeps the freed chunks below its
mmap threshold (which rises as large blocks are freed, up to 32 MB) in its heap, between chunks still in use, and
gives them back only from the heap's top: a larger model with its draft keeps gigabytes resident that nothing uses
after the target is built (docs/performance.md, "Start-up"). `malloc_trim` releases every free page; where the C
library has none (not glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    except OSError:
        return None


def trim_heap() -> bool:
    """Release the heap's free pages to the system; True where the C library could (glibc's `malloc_trim`)."""
    trim = _malloc_trim()
    return bool(trim and trim(0))
