"""A fused linear whose rows the file stored in two formats (Q4_K q/k beside a Q6_K v, as in Qwen2.5-Coder-1.5B's
Q4_K_M) keeps each run of rows in its own format, and computes what transformers does on those values."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM
from llmserve.evaluate.reference import quantized_reference, reference_greedy, reference_model
from llmserve.loader import load_checkpoint
from llmserve.quantization.weight_only import StackedLinear, WeightOnlyLinear
from tests.greedy import assert_greedy_equals
from tests.models.mixed_gguf import HIDDEN

PROMPTS = ["def is_prime(n):", "The three laws of thermodynamics are", "# Sort a list of tuples\n"]
# bits a weight of each q/k/v part (q and k, then v) under each method: int4 on Q4_K's grid in its super-block
# layout (4.625), fitted int4 in fp16 groups (5), int8 per row (8), Q6_K's own values in the 6-bit layout (6.625)
PART_BITS = {"int4+int8": [4.625, 6.625], "int4": [4.625, 5.0], "int8": [8.0, 6.625]}


@pytest.fixture(scope="module")
def reference(mixed_kquant_gguf):
    return reference_model(mixed_kquant_gguf, torch.float32)


@pytest.fixture(scope="module")
def checkpoint(mixed_kquant_gguf):
    return load_checkpoint(mixed_kquant_gguf)


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    return [checkpoint.tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("method", ["int4+int8", "int4", "int8"])
def test_rows_of_two_formats_each_keep_their_own(mixed_kquant_gguf, reference, checkpoint, prompts, method):
    grids, int8_grids = checkpoint.int4_grids, checkpoint.int8_grids
    assert {n.split(".")[-2] for n in grids} >= {"q_proj", "k_proj", "gate_proj", "up_proj"}
    assert {n.split(".")[-2] for n in int8_grids} == {"v_proj", "down_proj", "lm_head"}
    ref = quantized_reference(reference, method, grids, int8_grids)
    expected = [reference_greedy(ref, ids, 12) for ids in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)
    if method == "int4+int8":  # every weight at the file's own values: transformers on the file as it is
        assert expected == [reference_greedy(reference, ids, 12) for ids in prompts]
    llm = LLM(mixed_kquant_gguf, dtype="float32", quantization=method, kv_cache_memory_gb=0.1, max_model_len=512)
    model = llm.engine.runner.model
    for i, layer in enumerate(model.layers):
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv, StackedLinear) and [p.out_features for p in qkv.parts] == [384, 128]
        bits = [p.qweight.numel() * 8 / (p.out_features * HIDDEN) for p in qkv.parts]
        assert bits == PART_BITS[method]
        assert isinstance(layer.mlp.gate_up_proj, WeightOnlyLinear)  # gate and up: one format, one weight
        biases = [checkpoint.weights[f"model.layers.{i}.self_attn.{p}_proj.bias"] for p in "qkv"]
        assert torch.equal(qkv.bias, torch.cat(biases))  # each part adds its rows' own
    assert_greedy_equals(llm, prompts, expected, single=1)

