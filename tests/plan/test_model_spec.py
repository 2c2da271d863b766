"""Memory and KV arithmetic against hand computation, and the GGUF header against the model's architecture."""

from __future__ import annotations

import pytest

from llmserve.kv_cache.kv_quant import SCALE_BYTES
from llmserve.loader.default_models import resolve_model_path
from llmserve.plan.model_spec import GB, KV_ROW_SCALE_BYTES, ModelSpec, memory_fit, registered_model

LLAMA_8B = ModelSpec("llama-8b", num_params=8e9, num_layers=32, num_kv_heads=8, head_dim=128, num_heads=32)


def test_registered_model_shape_from_the_gguf_header() -> None:
    spec = registered_model("smollm2-135m")
    # SmolLM2-135M: 30 layers, hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, vocab 49152, tied
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576  # q, o; k, v; gate, up, down; 2 norms
    assert spec.num_params == 49152 * 576 + 30 * per_layer + 576
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_heads) == (30, 3, 64, 9)
    assert spec.max_context == 8192
    from_path = registered_model(resolve_model_path(None)[0])  # a GGUF path works as well as the name
    assert from_path.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (from_path.num_params, from_path.num_layers, from_path.head_dim) == (spec.num_params, 30, 64)


def test_kv_bytes_per_token_and_weights() -> None:
    spec = registered_model("smollm2-135m")
    assert spec.kv_bytes_per_token("bf16") == 2 * 30 * 3 * 64 * 2 == 23_040
    assert LLAMA_8B.kv_bytes_per_token("bf16") == 131_072  # 128 KiB: 2 x 32 x 8 x 128 x 2
    # a 1-byte cache row holds its float32 scale too: 128 values + 4 bytes
    assert LLAMA_8B.kv_bytes_per_token("fp8") == LLAMA_8B.kv_bytes_per_token("int8") == 2 * 32 * 8 * 132
    assert KV_ROW_SCALE_BYTES == SCALE_BYTES  # the planner's copy of the cache format's constant
    assert LLAMA_8B.weight_bytes("bf16") == 16e9
    assert LLAMA_8B.weight_bytes("int8") == pytest.approx(8e9 * (1 + 2 / 128))  # a bf16 scale per 128
    assert LLAMA_8B.weight_bytes("int4") == pytest.approx(8e9 * (0.5 + 4 / 32))  # scale + offset per 32


def test_memory_fit_on_an_80gb_card() -> None:
    fit = memory_fit(LLAMA_8B, "bf16", "bf16", memory_gb=80, tokens_per_seq=2048, usable_fraction=0.9)
    # usable 72 GB - 16 GB of weights = 56 GB; a 2048-token sequence holds 2048 x 128 KiB = 268,435,456 bytes
    assert fit.max_concurrency == int(56e9 // 268_435_456) == 208
    assert fit.fits(208) and not fit.fits(209)
    assert fit.kv_bytes(10) == 10 * 268_435_456
    small = memory_fit(LLAMA_8B, "bf16", "bf16", memory_gb=16, tokens_per_seq=2048)
    assert small.max_concurrency == 0 and not small.weights_fit  # 16 GB of weights in 14.4 usable
    assert memory_fit(LLAMA_8B, "int4", "bf16", memory_gb=16, tokens_per_seq=2048).max_concurrency == int(
        (14.4 * GB - 5e9) // 268_435_456)


def test_bad_shapes_and_formats_are_refused() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        ModelSpec("x", 1e9, 0, 8, 128)
    with pytest.raises(ValueError, match="num_heads"):
        ModelSpec("x", 1e9, 32, 8, 128, num_heads=4)
    with pytest.raises(ValueError, match="quantization"):
        LLAMA_8B.weight_bytes("int3")
    with pytest.raises(ValueError, match="not installed|neither"):
        registered_model("no-such-model")
