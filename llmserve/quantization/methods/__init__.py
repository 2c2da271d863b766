"""The linear layers' weight formats, one registered method each.

Why a registry: what a format is (its small-step product, what it costs in memory, how a tensor-parallel rank's
share of it must be cut, which of a file's tensor types it holds at their own values) was spread over the layer, the
build plan, the planner and tensor parallelism. Now a format is its module here (a `LinearMethod`: prepare a weight,
multiply a small step), its kernel, and one `LinearMethodSpec` line in `LINEAR_METHODS`; the rest reads the spec.

This module names formats only (no torch): `--help` and `llmserve plan` read the specs, and a method's module is
imported at its first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmserve.quantization.methods.base import LinearMethod


@dataclass(frozen=True)
class LinearMethodSpec:
    """What the rest of the engine knows about a weight format, without computing with it."""

    name: str
    bits: int  # stored bits per weight, scales aside
    group_size: int  # the weights one scale (and minimum) serves, for `llmserve plan` (0: none)
    scale_bytes: int  # the bytes of a group's scale (and minimum)
    small_step_tokens: int  # steps of at most this many tokens take the small-step kernel; past it a dense product
    # on the same values is faster (docs/performance.md, "Quantized weight kernels")
    shard_inputs: int  # a row-parallel rank's inputs must be a whole number of these (1: any cut)
    file_types: frozenset[str]  # a checkpoint's tensor formats (`Checkpoint.source_formats`) stored on a grid this
    # method holds exactly: a file of only these runs on it by default, at the file's own values
    implementation: str  # "module:class" of its `LinearMethod`
    # the one native decode call (kernels/decode_layer.cpp) reads this format's packed weights; a format it does not
    # know runs its decode steps layer by layer
    in_one_call: bool = False


LINEAR_METHODS: dict[str, LinearMethodSpec] = {spec.name: spec for spec in (
    # groups of 32 inputs, w = q * scale + min (GGUF's Q4_1 grid; Q4_0 and Q4_K held exactly; AWQ's and GPTQ's groups)
    LinearMethodSpec("int4", 4, 32, 4, 16, 32, frozenset({"Q4_0", "Q4_1", "Q4_K", "AWQ", "GPTQ"}),
                     "llmserve.quantization.methods.int4:Int4Method", in_one_call=True),
    # symmetric per output channel, or the file's Q6_K / Q8_0 / Q5_0 grid; "INT8": `llmserve quantize --method int8`
    LinearMethodSpec("int8", 8, 128, 2, 8, 1, frozenset({"Q6_K", "Q8_0", "Q5_0", "INT8"}),
                     "llmserve.quantization.methods.int8:Int8Method", in_one_call=True),
    # e4m3 bytes, a float32 scale per row and 128 inputs (vLLM's per-tensor / per-channel, DeepSeek's 128 x 128 blocks)
    LinearMethodSpec("fp8", 8, 128, 4, 8, 128, frozenset({"FP8"}), "llmserve.quantization.methods.fp8:Fp8Method"),
)}

# Mixes of methods, one per tensor: the first whose file grid holds the tensor, else the last. A K-quant file
# (mostly 4-bit, some tensors in more bits, as Q4_K_M files are) runs "int4+int8".
MIXED_METHODS: dict[str, tuple[str, ...]] = {"int4+int8": ("int4", "int8")}


def methods_of(weights: str) -> tuple[str, ...]:
    """The registered methods a model's weights choice runs on ("int4+int8": int4 and int8)."""
    return MIXED_METHODS.get(weights, (weights,))


def small_step_tokens(weights: str) -> int:
    """The largest step any of a weights choice's layers takes on its small-step kernel."""
    return max(LINEAR_METHODS[m].small_step_tokens for m in methods_of(weights))


@cache
def linear_method(name: str) -> LinearMethod:
    """The registered method `name`, its module imported at first use."""
    if name not in LINEAR_METHODS:
        raise ValueError(f"a layer's weight format is one of {sorted(LINEAR_METHODS)}, got {name!r}")
    module, cls = LINEAR_METHODS[name].implementation.split(":")
    return getattr(importlib.import_module(module), cls)(LINEAR_METHODS[name])
