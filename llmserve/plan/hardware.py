"""Machines to plan for: spec-sheet figures (memory, bandwidth, peak FLOP/s) and an hourly price.

Why spec sheets at all: we cannot measure an A100 or H100 from here, and a roofline estimate from the
data sheet (decode reads every weight once per step; prefill is arithmetic) is the usual first answer.
Where a machine can be measured, a `llmserve bench` result replaces the roofline (step_model.py) and
only the memory and price below are used.

The prices are examples (on-demand cloud list prices of 2025, rounded): edit PRESETS or pass
--dollars-per-hour, they change often and differ by provider.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from llmserve.plan.model_spec import GB


@dataclass(frozen=True)
class HardwareSpec:
    """One replica's machine. Efficiencies scale the peaks to what real kernels reach."""

    name: str
    memory_gb: float
    mem_bandwidth_gbs: float = 0.0  # 0: unknown (only a measured step model can be used)
    tflops: float = 0.0  # dense 16-bit peak
    dollars_per_hour: float = 0.0
    bandwidth_efficiency: float = 0.8  # share of peak bandwidth a decode step streams at
    compute_efficiency: float = 0.5  # share of peak FLOP/s a prefill reaches (MFU)
    step_overhead_ms: float = 1.0  # per engine step: launches, scheduling, sampling

    def __post_init__(self) -> None:
        if self.memory_gb <= 0:
            raise ValueError(f"hardware memory_gb must be > 0, got {self.memory_gb}")
        for name in ("mem_bandwidth_gbs", "tflops", "dollars_per_hour", "step_overhead_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware {name} must be >= 0, got {getattr(self, name)}")
        for name in ("bandwidth_efficiency", "compute_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def has_roofline(self) -> bool:
        return self.mem_bandwidth_gbs > 0 and self.tflops > 0

    @property
    def bytes_per_s(self) -> float:
        return self.mem_bandwidth_gbs * GB * self.bandwidth_efficiency

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12 * self.compute_efficiency


PRESETS: dict[str, HardwareSpec] = {
    "h100-80gb": HardwareSpec("h100-80gb", memory_gb=80, mem_bandwidth_gbs=3350, tflops=989, dollars_per_hour=2.90),
    "a100-80gb": HardwareSpec("a100-80gb", memory_gb=80, mem_bandwidth_gbs=2039, tflops=312, dollars_per_hour=1.80),
    "a100-40gb": HardwareSpec("a100-40gb", memory_gb=40, mem_bandwidth_gbs=1555, tflops=312, dollars_per_hour=1.30),
    "l4": HardwareSpec("l4", memory_gb=24, mem_bandwidth_gbs=300, tflops=121, dollars_per_hour=0.70),
    "a10g": HardwareSpec("a10g", memory_gb=24, mem_bandwidth_gbs=600, tflops=70, dollars_per_hour=1.00),
    # a 2-vCPU AVX-512 cloud VM like this project's hosts: DDR5 shared with neighbours, bf16 dot products
    "cpu-2core": HardwareSpec("cpu-2core", memory_gb=16, mem_bandwidth_gbs=40, tflops=0.4, dollars_per_hour=0.08,
                              bandwidth_efficiency=0.5, compute_efficiency=0.5, step_overhead_ms=3.0),
    "cpu-32core": HardwareSpec("cpu-32core", memory_gb=128, mem_bandwidth_gbs=300, tflops=6.0, dollars_per_hour=1.30,
                               bandwidth_efficiency=0.5, compute_efficiency=0.5, step_overhead_ms=3.0),
}


def hardware(preset: str | None, **overrides: float | None) -> HardwareSpec:
    """A preset with some figures overridden, or (no preset) a machine built from the overrides alone,
    its memory defaulting to this host's (the machine a bench file was measured on is usually this one)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown hardware {preset!r}; presets: {', '.join(PRESETS)}")
        return replace(PRESETS[preset], **given)
    given.setdefault("memory_gb", host_memory_gb())
    return HardwareSpec(name="custom", **given)


def host_memory_gb() -> float:
    """Physical memory of this machine (GB), from the page count."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
