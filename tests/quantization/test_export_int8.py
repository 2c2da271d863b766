"""`llmserve quantize --method int8` (also `--method int4`): the served checkpoint holds the values of the model
that wrote it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from llmserve import LLM, SamplingParams
from llmserve.cli import main as cli_main
from llmserve.loader import load_checkpoint
from llmserve.quantization.int4_groups import fit_groups
from llmserve.quantization.weight_only import WeightOnlyLinear
from tests.quantization.tiny_models import make_tiny_hf_dir

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny"), "llama", kv_heads=2)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_int8_checkpoint_serves_the_values_that_wrote_it(tiny, tmp_path):
    writer = LLM(str(tiny), quantization="int8", kv_cache_memory_gb=0.05)
    dtype = str(writer.engine.dtype).removeprefix("torch.")
    assert cli_main(["quantize", str(tiny), "--method", "int8", "--dtype", dtype, "--out", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.int8
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale").shape == (256, 1)
    served = LLM(str(tmp_path), kv_cache_memory_gb=0.05)  # auto: int8, as stored
    assert served.engine.plan.weights == "int8"
    for a, b in zip(writer.engine.runner.model.modules(), served.engine.runner.model.modules(), strict=True):
        if isinstance(a, WeightOnlyLinear):
            assert torch.equal(a.qweight, b.qweight)
            torch.testing.assert_close(a.scales, b.scales, rtol=2**-22, atol=0)  # the same, to float32's last bit
    assert _greedy(served) == _greedy(writer)


def test_int4_checkpoint_is_round_to_nearest_on_the_same_groups(tiny, tmp_path):
    assert cli_main(["quantize", str(tiny), "--method", "int4", "--group-size", "128", "--out", str(tmp_path)]) == 0
    ckpt = load_checkpoint(str(tmp_path))
    source = load_checkpoint(str(tiny))
    name = "model.layers.1.self_attn.o_proj.weight"
    groups = ckpt.int4_groups[name]
    expected = fit_groups(source.weights[name], 128)
    assert groups.group_size == 128 and torch.equal(groups.q, expected.q) and torch.equal(groups.zeros, expected.zeros)
    # nothing folded: every other tensor is the source's
    assert torch.equal(ckpt.weights["model.layers.0.input_layernorm.weight"],
                       source.weights["model.layers.0.input_layernorm.weight"])
    assert json.loads((tmp_path / "config.json").read_text())["llmserve_quantization"]["method"] == "int4"
