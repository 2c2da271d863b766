"""`trim_heap` gives freed heap pages back: what glibc keeps resident after a model load's temporaries."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROGRAM = r"""
import sys
from llmserve.engine.heap import trim_heap

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6

freed = bytearray(24 << 20); del freed  # glibc raises its mmap threshold to 24 MB: what follows is heap
chunks, pins = [], []
for _ in range(200):  # 4 MB chunks, each pinned in place by a small one after it, as a load leaves its heap
    chunks.append(bytearray(4 << 20))
    chunks[-1][::4096] = b"x" * (1 << 10)  # every page touched
    pins.append(bytearray(1024))
del chunks
before = resident_mb()
released = trim_heap()
print(released, before, resident_mb())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's heap only")
def test_freed_heap_pages_leave_the_resident_set() -> None:
    out = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, check=True).stdout.split()
    released, before, after = out[0] == "True", float(out[1]), float(out[2])
    assert before > 600  # the freed chunks were still resident: the case this is for
    assert released and after < before - 600, (before, after)
