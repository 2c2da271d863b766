"""Facts about the machine the engine runs on, read once: what the build plan and the kernel cache key on."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), so bf16 is faster, not slower."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
