"""The weight-format registry: every registered format is what the layer, the plan, the planner and tensor
parallelism read, and a format defined outside the package plugs in with one registry entry."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmserve.config import QUANTIZATION_METHODS
from llmserve.distributed.tensor_parallel import check_shardable
from llmserve.layers.linear import prepack_linears
from llmserve.loader.gguf import INT4_GRID_FORMATS
from llmserve.models.config import ModelConfig
from llmserve.plan.model_spec import WEIGHT_FORMATS
from llmserve.quantization.methods import (
    LINEAR_METHODS,
    MIXED_METHODS,
    LinearMethodSpec,
    linear_method,
    small_step_tokens,
)
from llmserve.quantization.methods.base import LinearMethod, PreparedWeight, SmallStep
from llmserve.quantization.weight_only import WeightOnlyLinear


def test_every_registered_format_is_served_planned_and_offered():
    for name, spec in LINEAR_METHODS.items():
        method = linear_method(name)
        assert isinstance(method, LinearMethod) and method.spec is spec and method.name == name
        assert name in QUANTIZATION_METHODS
        assert WEIGHT_FORMATS[name].bytes_per_weight == spec.bits / 8 + spec.scale_bytes / spec.group_size
    assert all(mix in QUANTIZATION_METHODS and set(parts) <= set(LINEAR_METHODS) for mix, parts in
               MIXED_METHODS.items())
    assert small_step_tokens("int4+int8") == max(small_step_tokens("int4"), small_step_tokens("int8"))
    # the GGML types whose 4-bit grid the GGUF loader reads are the ones int4 claims to hold
    assert INT4_GRID_FORMATS <= LINEAR_METHODS["int4"].file_types
    with pytest.raises(ValueError, match="weight format"):
        linear_method("int3")


def test_the_registry_and_the_config_import_no_torch():
    """`--help` reads the registry: naming the formats must not pay for torch's import."""
    code = "import sys, llmserve.config, llmserve.quantization.methods; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


class _Bf16Method(LinearMethod):
    """A format of the tests' own: bf16-rounded values, the small step PyTorch's dense product on them."""

    def native_packs(self, out_features: int, in_features: int) -> bool:
        return False

    def prepare(self, weight: torch.Tensor, grid, native: bool, dense: bool = True) -> PreparedWeight:
        rounded = weight.to(torch.bfloat16)
        return PreparedWeight(rounded, None, rounded.to(weight.dtype), "bf16")

    def small_step(self, native: bool) -> SmallStep:
        return lambda layer, x: (x.to(torch.bfloat16) @ layer.qweight.T).to(x.dtype)


@pytest.fixture
def bf16_format(monkeypatch):
    spec = LinearMethodSpec("test-bf16", 16, 0, 0, 4, 128, frozenset(), f"{__name__}:_Bf16Method")
    monkeypatch.setitem(LINEAR_METHODS, spec.name, spec)
    linear_method.cache_clear()
    yield spec
    linear_method.cache_clear()


def test_a_format_plugs_in_with_one_registry_entry(bf16_format):
    """The entry alone gives a layer that takes it (both products, with its bias, packed for large steps) and
    tensor parallelism's cut rule."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 128, generator=g), torch.randn(48, generator=g)
    layer = WeightOnlyLinear(weight, "test-bf16", bias=bias)
    assert layer.layout == "bf16" and layer.max_quantized_tokens == bf16_format.small_step_tokens
    rounded = weight.to(torch.bfloat16).float()
    small, large = torch.randn(4, 128, generator=g), torch.randn(5, 128, generator=g)
    expected_small = (small.to(torch.bfloat16) @ rounded.to(torch.bfloat16).T).float() + bias
    torch.testing.assert_close(layer(small), expected_small)
    prepack_linears(torch.nn.Sequential(layer))
    torch.testing.assert_close(layer(large), large @ rounded.T + bias, rtol=1e-5, atol=1e-5)
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                      tie_word_embeddings=True)
    check_shardable(cfg, 2, "int4")  # 64 o_proj inputs a rank: whole groups of 32
    with pytest.raises(ValueError, match="test-bf16 groups of 128"):
        check_shardable(cfg, 2, "test-bf16")  # the format wants 128
