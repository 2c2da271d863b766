"""AutoAWQ's GEMM layout: our packing equals AutoAWQ's own loop (`WQLinear_GEMM.from_linear`), and unpacks back."""

from __future__ import annotations

import pytest
import torch

from llmserve.loader.awq_format import pack_awq, read_awq_tensors, unpack_awq
from llmserve.quantization.int4_groups import fit_groups


def _autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ 0.2.9's packing, as written there: intweight [in, out] -> int32 [in, out / 8]."""
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=torch.int32)
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]].to(torch.int32) << (i * 4)
    return qweight


@pytest.mark.parametrize("group_size", [32, 128])
def test_packing_is_autoawqs_and_unpacks_to_the_same_groups(group_size):
    torch.manual_seed(0)
    groups = fit_groups(torch.randn(48, 256) * 0.05, group_size)
    packed = pack_awq(groups)
    assert packed["qweight"].dtype == torch.int32 and packed["qweight"].shape == (256, 6)
    assert packed["qzeros"].shape == (256 // group_size, 6) and packed["scales"].shape == (256 // group_size, 48)
    assert packed["scales"].dtype == torch.float16
    assert torch.equal(packed["qweight"], _autoawq_pack(groups.q.t()))
    assert torch.equal(packed["qzeros"], _autoawq_pack(groups.zeros.t()))
    assert (packed["qweight"] < 0).any()  # high nibbles set: the sign bit is handled
    back = unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], group_size)
    assert torch.equal(back.q, groups.q) and torch.equal(back.zeros, groups.zeros)
    assert torch.equal(back.scales, groups.scales)


def test_read_awq_tensors_dequantizes_each_linear_and_keeps_the_rest():
    groups = fit_groups(torch.randn(16, 64), 32)
    tensors = {f"model.layers.0.mlp.down_proj.{k}": v for k, v in pack_awq(groups).items()}
    tensors["model.norm.weight"] = torch.ones(16)
    weights, read = read_awq_tensors(tensors, {"quant_method": "awq", "bits": 4, "group_size": 32,
                                               "zero_point": True, "version": "GEMM"})
    assert set(weights) == {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"], groups.dequantize())
    with pytest.raises(ValueError, match="GEMM layout"):
        read_awq_tensors(tensors, {"bits": 4, "group_size": 32, "version": "gemv"})
    del tensors["model.layers.0.mlp.down_proj.qzeros"]
    with pytest.raises(ValueError, match="without its qzeros"):
        read_awq_tensors(tensors, {"bits": 4, "group_size": 32})


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_written_config_reads_back_as_the_same_model(architecture):
    from llmserve.models.config import ModelConfig
    from llmserve.models.families import config_from_hf, config_to_hf

    config = ModelConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=4096, tie_word_embeddings=architecture == "LlamaForCausalLM",
                         attention_bias=architecture == "Qwen2ForCausalLM",
                         rope_scaling={"rope_type": "llama3", "factor": 8.0} if architecture == "LlamaForCausalLM"
                         else None, architecture=architecture)
    assert config_from_hf(config_to_hf(config)) == config
