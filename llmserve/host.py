"""Facts about the machine the engine runs on, read once: what the build plan and the kernel cache key on."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("" where there is none)."""
    return _cpuinfo("model name")


def _cpuinfo(key: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(key)), "").partition(":")[2].strip()
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), so bf16 is faster, not slower."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_has_vnni() -> bool:
    """True where the CPU multiplies uint8 by int8 into int32 sums (VNNI, AVX-512 or AVX, or AMX). Without it
    oneDNN's int8 x int8 products run on `vpmaddubsw`, whose int16 pair sums saturate (255 * 127 twice is
    more than 32767): results that are wrong, not slower, so int8 activations need it."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def transparent_huge_pages() -> str:
    """Linux's transparent huge page mode for anonymous memory: "always", "madvise" (on request) or "never"
    ("" where there is no such setting, as off Linux)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return ""
    return text.partition("[")[2].partition("]")[0]
