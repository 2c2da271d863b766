"""The spec-sheet (roofline) step model against hand computation."""

from __future__ import annotations

import pytest

from llmserve.plan.hardware import PRESETS, hardware
from llmserve.plan.model_spec import ModelSpec
from llmserve.plan.step_model import chunk_pairs, roofline_step_model

LLAMA_8B = ModelSpec("llama-8b", num_params=8e9, num_layers=32, num_kv_heads=8, head_dim=128, num_heads=32)


def test_decode_is_memory_bound_and_prefill_compute_bound_on_an_h100() -> None:
    h100 = PRESETS["h100-80gb"]  # 3350 GB/s x 0.8, 989 TFLOP/s x 0.5, 1 ms a step
    sm = roofline_step_model(LLAMA_8B, h100, "bf16", "bf16")
    bw, peak = 3350e9 * 0.8, 989e12 * 0.5
    # one decode row with 1000 tokens of context: 16 GB of weights + 1001 tokens of KV (128 KiB each)
    decode = (16e9 + 131_072 * 1001) / bw
    assert sm.step_time(1, 1000, 0, 0.0) == pytest.approx(1e-3 + decode)
    # a 2000-token prompt: 2 x 8e9 FLOPs a token, and 4 x 32 layers x 32 heads x 128 per (query, key) pair
    pairs = chunk_pairs(0, 2000)
    assert pairs == 2000 * 2001 / 2
    prefill = (2 * 8e9 * 2000 + 4 * 32 * 32 * 128 * pairs) / peak
    assert prefill > (16e9 + 131_072 * 2000) / bw  # compute-bound
    assert sm.step_time(0, 0, 2000, pairs) == pytest.approx(1e-3 + prefill)
    # batching amortises the weights: 64 rows cost far less than 64 single steps
    assert sm.step_time(64, 64 * 1000, 0, 0.0) < 4 * sm.step_time(1, 1000, 0, 0.0)


def test_int4_weights_make_decode_faster() -> None:
    a100 = PRESETS["a100-80gb"]
    bf16 = roofline_step_model(LLAMA_8B, a100, "bf16", "bf16").step_time(1, 500, 0, 0.0)
    int4 = roofline_step_model(LLAMA_8B, a100, "int4", "bf16").step_time(1, 500, 0, 0.0)
    assert int4 < bf16 * 0.4


def test_hardware_overrides_and_needs() -> None:
    hw = hardware("l4", dollars_per_hour=0.5, memory_gb=None)
    assert hw.dollars_per_hour == 0.5 and hw.memory_gb == 24
    custom = hardware(None, memory_gb=10.0)
    assert custom.memory_gb == 10.0 and not custom.has_roofline
    with pytest.raises(ValueError, match="mem_bandwidth_gbs and tflops"):
        roofline_step_model(LLAMA_8B, custom, "bf16", "bf16")
    with pytest.raises(ValueError, match="unknown hardware"):
        hardware("tpu-v9")
    with pytest.raises(ValueError, match="efficiency"):
        hardware("l4", compute_efficiency=1.5)
