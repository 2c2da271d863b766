"""GPTQ's layout: our packing equals AutoGPTQ's own loops, and our reading equals GPTQModel's dequantization.

No GPTQ library installs on this CPU (GPTQModel 7.7 needs torch >= 2.14 and pyarrow, AutoGPTQ 0.7 builds CUDA
extensions), so their code is transcribed here as written there: AutoGPTQ 0.7.1's `QuantLinear.pack` (qlinear_cuda_old,
the v1 layout every reader takes) and GPTQModel 7.7.0's `PackableQuantLinear.dequantize_weight` with its v1 -> v2
zero-point conversion (`convert_gptq_v1_to_v2_format_module`: qzeros += 0x11111111)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.loader.gptq_format import pack_gptq, quantization_config, read_gptq_tensors, unpack_gptq
from llmserve.quantization.int4_groups import Int4Groups


def _groups(out_features: int, in_features: int, group_size: int, sym: bool, seed: int = 0) -> Int4Groups:
    generator = torch.Generator().manual_seed(seed)
    n_groups = in_features // group_size
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32)
    zeros = (torch.full((out_features, n_groups), 8, dtype=torch.int32) if sym else
             torch.randint(0, 16, (out_features, n_groups), generator=generator, dtype=torch.int32))
    scales = (torch.rand(out_features, n_groups, generator=generator) * 0.01 + 1e-4).half().float()
    return Int4Groups(q, scales, zeros, group_size)


def _autogptq_pack(intweight: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ 0.7.1 `QuantLinear.pack`'s loops (bits 4): intweight [in, out], zeros [groups, out] -> qweight
    [in / 8, out], qzeros [groups, out / 8], the zeros stored minus one."""
    bits = 4
    intweight = intweight.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    zeros = (zeros - 1).astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return qweight.astype(np.int32), qzeros.astype(np.int32)


def _gptqmodel_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                          v1: bool) -> torch.Tensor:
    """GPTQModel 7.7.0's `dequantize_weight` (bits 4, pack dtype int32), after its v1 -> v2 conversion: [in, out]."""
    if v1:
        qzeros = qzeros + 0b00010001000100010001000100010001
    wf = torch.tensor(list(range(0, 32, 4)), dtype=torch.int32)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 8), wf.unsqueeze(0)).to(torch.int16)
    zeros = torch.bitwise_and(zeros, 15).reshape(qzeros.shape[0], -1)
    weight = torch.bitwise_and(torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 8, -1),
                                                         wf.unsqueeze(-1)).to(torch.int16), 15)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


@pytest.mark.parametrize("group_size", [32, 128])
def test_packing_is_autogptqs_and_unpacks_to_the_same_groups(group_size):
    groups = _groups(64, 256, group_size, sym=False)  # AutoGPTQ's loops take whole multiples of 32 outputs
    groups = Int4Groups(groups.q, groups.scales, groups.zeros.clamp(min=1), group_size)  # v1 stores z - 1
    packed = pack_gptq(groups, "gptq")
    assert packed["qweight"].dtype == torch.int32 and packed["qweight"].shape == (256 // 8, 64)  # [in / 8, out]
    assert packed["qzeros"].shape == (256 // group_size, 64 // 8) and packed["scales"].shape == (256 // group_size, 64)
    assert packed["scales"].dtype == torch.float16
    assert torch.equal(packed["g_idx"], (torch.arange(256) // group_size).to(torch.int32))
    qweight, qzeros = _autogptq_pack(groups.q.t().numpy(), groups.zeros.t().numpy())
    assert torch.equal(packed["qweight"], torch.from_numpy(qweight))
    assert torch.equal(packed["qzeros"], torch.from_numpy(qzeros))
    assert (packed["qweight"] < 0).any()  # high nibbles set: the sign bit is handled
    back = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], group_size)
    assert torch.equal(back.q, groups.q) and torch.equal(back.zeros, groups.zeros)
    assert torch.equal(back.scales, groups.scales)


@pytest.mark.parametrize(("checkpoint_format", "sym"), [("gptq", True), ("gptq_v2", False), ("gptq_v2", True)])
def test_reading_equals_gptqmodels_dequantization(checkpoint_format, sym):
    groups = _groups(64, 128, 32, sym=sym, seed=1)
    packed = pack_gptq(groups, checkpoint_format)
    theirs = _gptqmodel_dequantize(packed["qweight"], packed["qzeros"], packed["scales"].float(), packed["g_idx"],
                                   v1=checkpoint_format == "gptq")
    ours = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 32, checkpoint_format)
    assert torch.equal(ours.dequantize(), theirs.t())


def test_v1_cannot_store_a_zero_point_of_zero():
    groups = _groups(16, 64, 32, sym=False, seed=2)
    groups.zeros[0, 0] = 0
    with pytest.raises(ValueError, match="write gptq_v2"):
        pack_gptq(groups, "gptq")
    assert pack_gptq(groups, "gptq_v2")["qzeros"][0, 0] & 15 == 0


def test_read_gptq_tensors_dequantizes_each_linear_and_refuses_what_it_cannot_run():
    groups = _groups(16, 64, 32, sym=True, seed=3)
    config = quantization_config(32, sym=True, act_order=False, damp_percent=0.01)
    tensors = {f"model.layers.0.mlp.down_proj.{k}": v for k, v in pack_gptq(groups).items()}
    tensors["model.norm.weight"] = torch.ones(16)
    weights, read = read_gptq_tensors(tensors, config)
    assert set(weights) == {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"], groups.dequantize())
    assert read["model.layers.0.mlp.down_proj.weight"].group_size == 32
    shuffled = dict(tensors)
    shuffled["model.layers.0.mlp.down_proj.g_idx"] = torch.tensor([0, 1] * 32, dtype=torch.int32)  # act order
    with pytest.raises(ValueError, match="groups are shuffled"):
        read_gptq_tensors(shuffled, {**config, "desc_act": True})
    with pytest.raises(ValueError, match="not bits=8"):
        read_gptq_tensors(tensors, {**config, "bits": 8})
    with pytest.raises(ValueError, match="checkpoint_format is one of"):
        read_gptq_tensors(tensors, {**config, "checkpoint_format": "marlin"})
    del tensors["model.layers.0.mlp.down_proj.qzeros"]
    with pytest.raises(ValueError, match="without its qzeros"):
        read_gptq_tensors(tensors, config)
