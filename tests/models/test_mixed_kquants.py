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
from tests.models.mixed_gguf import HIDDEN, INTERMEDIATE

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
    ref = quantized_reference(reference, method, checkpoint.grids)
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


def test_a_q5_0_and_q8_0_file_runs_int8_at_its_own_values(legacy_quant_gguf):
    """A file whose linears are Q5_0 and Q8_0 alone: the default plans int8, every decoder linear on the grouped
    layout (8.5 bits a weight, the file's values), the Q8_0 head per row; greedy equal to transformers on those
    weights, batched and alone, and the KV blocks all returned."""
    checkpoint = load_checkpoint(legacy_quant_gguf)
    formats = {fmt for name, fmt in checkpoint.source_formats.items() if "layers" in name and name.endswith("weight")
               and "norm" not in name}
    assert formats == {"Q5_0", "Q8_0"}
    reference = reference_model(legacy_quant_gguf, torch.float32)
    ref = quantized_reference(reference, "int8", checkpoint.grids)
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS]
    expected = [reference_greedy(ref, ids, 12) for ids in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)
    llm = LLM(legacy_quant_gguf, dtype="float32", kv_cache_memory_gb=0.1, max_model_len=512)
    assert llm.engine.plan.weights == "int8" and "on a grid int8 holds" in llm.engine.plan.reasons["weights"]
    model = llm.engine.runner.model
    linears = [(linear, inputs) for layer in model.layers for linear, inputs in (
        (layer.self_attn.qkv_proj, HIDDEN), (layer.self_attn.o_proj, HIDDEN), (layer.mlp.gate_up_proj, HIDDEN),
        (layer.mlp.down_proj, INTERMEDIATE))]
    assert all(m.layout == "grouped" and m.qweight.numel() * 16 == m.out_features * inputs * 17
               for m, inputs in linears)
    assert model.lm_head.layout == "per row" and model.lm_head.qweight.numel() == model.lm_head.out_features * HIDDEN
    assert_greedy_equals(llm, prompts, expected, single=1)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
