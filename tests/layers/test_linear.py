"""Prepacked dense linears: the same product as `F.linear`, bit for bit in bf16, eager and compiled; float32's
within its rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmserve.layers.linear import PackedLinear, packs, prepack_linears, release_plain_weights
from llmserve.quantization.weight_only import WeightOnlyLinear

NEEDS_BF16 = pytest.mark.skipif(not packs(torch.zeros(1, 1, dtype=torch.bfloat16)),
                                reason="oneDNN runs no bf16 on this CPU")


@NEEDS_BF16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linear_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.packed is not None and packed.weight is linear.weight  # shared, not copied
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    assert torch.equal(packed(x), nn.functional.linear(x, linear.weight, linear.bias))


@NEEDS_BF16
def test_prepack_linears_swaps_dense_layers_and_fills_quantized_ones():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(128, 64, bias=False, dtype=torch.bfloat16),
        WeightOnlyLinear(torch.randn(32, 64, dtype=torch.bfloat16), "int4"),
        nn.Linear(64, 8, dtype=torch.float16),  # no packed form: left as it is
    )
    x = torch.randn(40, 128, dtype=torch.bfloat16)  # 40 rows: the quantized layer's dense path
    before = model[1](model[0](x))
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and model[1].packed is not None
    assert isinstance(model[2], nn.Linear) and not isinstance(model[2], PackedLinear)
    assert torch.equal(model[1](model[0](x)), before)


@NEEDS_BF16
def test_compiled_packed_linear_traces_the_plain_weight():
    linear = PackedLinear(nn.Linear(64, 32, bias=False, dtype=torch.bfloat16))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    compiled = torch.compile(linear, fullgraph=True)
    torch.testing.assert_close(compiled(x), linear(x))


def _tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    embedding = nn.Embedding(64, 128, dtype=torch.bfloat16)
    head = nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    head.weight = embedding.weight  # tied
    return nn.Sequential(
        nn.Linear(128, 128, dtype=torch.bfloat16),
        WeightOnlyLinear(torch.randn(128, 128, dtype=torch.bfloat16), "int4"),
        head,
        nn.Linear(64, 8, dtype=torch.float16),
        embedding,
    )


@NEEDS_BF16
@pytest.mark.parametrize("as_packed", [False, True])
def test_released_plain_weights_leave_the_same_products(as_packed):
    """Once packed, the plain copies go (eager steps read only the packed ones), after packing them all or each as it
    is packed (the engine's way: one layer's weight twice at a time); a weight another module holds (a tied
    embedding) stays there, and the unpacked float16 layer keeps its own."""
    model = _tied_model()
    x = torch.randn(40, 128, dtype=torch.bfloat16)  # 40 rows: the quantized layer's dense path
    prepack_linears(model)
    before = model[:3](x)
    if as_packed:
        model = _tied_model()
        assert prepack_linears(model, release_plain=True) == 3
    else:
        assert release_plain_weights(model) == 3
    assert model[0].weight is None and model[1].weight is None and model[2].weight is None
    assert torch.equal(model[:3](x), before)
    assert model[4].weight is not None and model[3].weight is not None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_float32_dense_and_quantized_layers_pack(rows):
    """In float32 dense layers and a quantized layer's large steps take oneDNN's packed product (MKL's sgemm ran
    1.2-12x slower on AMD hosts); its sums round in their own order, within float32's rounding of `F.linear`."""
    torch.manual_seed(rows)
    model = nn.Sequential(nn.Linear(128, 128), WeightOnlyLinear(torch.randn(128, 128), "int4"))
    dense, bias, dequantized = model[0].weight.clone(), model[0].bias.clone(), model[1].weight.clone()
    assert prepack_linears(model, release_plain=True) == 2
    assert isinstance(model[0], PackedLinear) and model[0].weight is None and model[0].packed is not None
    assert model[1].packed is not None and model[1].weight is None
    x = torch.randn(rows, 128)
    h = model[0](x)
    torch.testing.assert_close(h, nn.functional.linear(x, dense, bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(40, 128)  # past the int4 kernel's tokens: the large step
    torch.testing.assert_close(model[1](x), nn.functional.linear(x, dequantized), rtol=1e-5, atol=1e-5)
