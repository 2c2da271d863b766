"""How long one engine step takes, given what it carries: the simulator's only notion of a machine.

A step runs some decode rows (one token each, attending to their context) and some prompt-chunk tokens,
as our scheduler builds it. Two models:

- `LinearStepModel`, fitted to `llmserve bench` results measured on the machine (fit.py):
  t = overhead + per_row x decode rows + per_prefill_token x prompt tokens + per_pair x attention pairs.
- `RooflineStepModel`, from a spec sheet: max(bytes read / bandwidth, FLOPs / peak) + a fixed overhead;
  decode reads every weight once per step (which batching amortises) plus the batch's KV.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from llmserve.plan.hardware import HardwareSpec
from llmserve.plan.model_spec import ModelSpec


class StepModel(Protocol):
    def step_time(self, decode_rows: int, decode_context: int, prefill_tokens: int, prefill_pairs: float) -> float:
        """Seconds for one step. decode_context: KV tokens all decode rows attend to, summed;
        prefill_pairs: (query, key) pairs of the step's prompt chunks."""
        ...

    def describe(self) -> dict[str, Any]: ...


def chunk_pairs(start: int, n: int) -> float:
    """(query, key) pairs of a prompt chunk of n tokens after `start` computed ones (causal)."""
    return n * start + n * (n + 1) / 2


@dataclass(frozen=True)
class LinearStepModel:
    overhead_s: float
    per_decode_row_s: float
    per_prefill_token_s: float
    per_attention_pair_s: float = 0.0

    def step_time(self, decode_rows: int, decode_context: int, prefill_tokens: int, prefill_pairs: float) -> float:
        return (self.overhead_s + self.per_decode_row_s * decode_rows + self.per_prefill_token_s * prefill_tokens
                + self.per_attention_pair_s * (decode_context + prefill_pairs))

    def describe(self) -> dict[str, Any]:
        return {"kind": "linear (fitted to bench results)", **asdict(self)}


@dataclass(frozen=True)
class RooflineStepModel:
    """Spec-sheet estimate for one replica; build it with `roofline_step_model` (the figures below are
    per step or per token, worked out once: a simulation calls step_time a million times)."""

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    flops_per_attention_pair: float
    bytes_per_s: float
    flops_per_s: float
    overhead_s: float
    source: dict[str, Any]

    def step_time(self, decode_rows: int, decode_context: int, prefill_tokens: int, prefill_pairs: float) -> float:
        tokens = decode_rows + prefill_tokens
        bytes_read = self.weight_bytes + self.kv_bytes_per_token * (decode_context + tokens)
        flops = self.flops_per_token * tokens + self.flops_per_attention_pair * (decode_context + prefill_pairs)
        return self.overhead_s + max(bytes_read / self.bytes_per_s, flops / self.flops_per_s)

    def describe(self) -> dict[str, Any]:
        return {"kind": "roofline (spec sheet)", **self.source}


def roofline_step_model(model: ModelSpec, hardware: HardwareSpec, quantization: str,
                        kv_dtype: str) -> RooflineStepModel:
    """Decode reads every weight once per step plus the batch's KV; FLOPs are 2 per parameter and token plus
    attention; the step takes the longer of the two at the hardware's efficient rates, plus its overhead."""
    if not hardware.has_roofline:
        raise ValueError(f"hardware {hardware.name!r} needs mem_bandwidth_gbs and tflops for a spec-sheet "
                         "estimate (or give a bench result measured on it)")
    source = {"bandwidth_gbs": hardware.mem_bandwidth_gbs, "tflops": hardware.tflops,
              "bandwidth_efficiency": hardware.bandwidth_efficiency,
              "compute_efficiency": hardware.compute_efficiency, "step_overhead_ms": hardware.step_overhead_ms,
              "quantization": quantization, "kv_dtype": kv_dtype}
    return RooflineStepModel(
        weight_bytes=model.weight_bytes(quantization), kv_bytes_per_token=model.kv_bytes_per_token(kv_dtype),
        flops_per_token=model.linear_flops_per_token(), flops_per_attention_pair=model.attention_flops(1.0),
        bytes_per_s=hardware.bytes_per_s, flops_per_s=hardware.flops_per_s,
        overhead_s=hardware.step_overhead_ms / 1e3, source=source)
