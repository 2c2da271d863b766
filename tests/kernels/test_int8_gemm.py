"""The AMX int8 x int8 product: bit for bit the oneDNN call it replaces (its portable loops on any CPU,
the AMX tiles where they exist), for token counts on and off its 32-row blocks, both output dtypes and
SmolLM2's shapes; bad inputs raise."""

from __future__ import annotations

import pytest
import torch

from llmserve.host import cpu_has_vnni
from llmserve.kernels import amx_int8_gemm, load_cpu_kernels
from llmserve.kernels.int8_gemm import pack_int8_for_amx
from llmserve.quantization.int8_activations import pack_int8_weight

SHAPES = [(64, 64), (960, 576), (576, 1536)]  # (out, in): a small one and SmolLM2's qkv and down
TOKENS = [1, 9, 17, 32, 33, 70]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _case(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen)
    x[:, 3] *= 40  # an outlier channel: rows use their whole range differently
    xu, row_scales = torch.ops.llmserve.quantize_activations_u8(x, torch.ones(k))
    return q, scales, xu, row_scales


def _onednn(q, scales, xu, row_scales, dtype):
    """What `int8_linear` computes without the AMX kernel."""
    zeros = torch.zeros(len(scales), dtype=torch.int64)
    y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, pack_int8_weight(q), scales, zeros, None, 1.0, 0,
                                           torch.float32, "none", [], "")
    return (y * row_scales).to(dtype)


@pytest.mark.skipif(not cpu_has_vnni(), reason="without VNNI oneDNN's int8 product saturates its int16 pair sums: "
                    "the build plan refuses int8 activations there (tests/engine/test_build_plan.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_portable_loops_equal_onednn_bit_for_bit(n, k, dtype):
    for m in (1, 17, 33):
        q, scales, xu, row_scales = _case(m, n, k)
        packed, comp = pack_int8_for_amx(q)
        out = torch.ops.llmserve.int8_gemm_portable(xu, row_scales, packed, scales, comp, dtype)
        assert torch.equal(out, _onednn(q, scales, xu, row_scales, dtype)), (m, n, k)


@pytest.mark.skipif(not amx_int8_gemm(), reason="this CPU has no AMX (its portable loops are tested above)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_amx_tiles_equal_onednn_bit_for_bit(n, k, dtype):
    for m in TOKENS:
        q, scales, xu, row_scales = _case(m, n, k, seed=m)
        packed, comp = pack_int8_for_amx(q)
        out = torch.ops.llmserve.int8_gemm(xu, row_scales, packed, scales, comp, dtype)
        assert out.shape == (m, n) and out.dtype == dtype
        assert torch.equal(out, _onednn(q, scales, xu, row_scales, dtype)), (m, n, k)


def test_compensation_is_the_zero_point_times_each_channels_sum():
    q = torch.randint(-127, 128, (64, 128), generator=torch.Generator().manual_seed(1)).to(torch.int8)
    _, comp = pack_int8_for_amx(q)
    assert torch.equal(comp, q.long().sum(dim=1).mul(128).int())


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int8_for_amx(torch.zeros(48, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="in_features % 64"):
        pack_int8_for_amx(torch.zeros(64, 96, dtype=torch.int8))
    q, scales, xu, row_scales = _case(4, 64, 128)
    packed, comp = pack_int8_for_amx(q)
    gemm = torch.ops.llmserve.int8_gemm_portable
    with pytest.raises(RuntimeError, match="does not match"):
        gemm(xu[:, :64].contiguous(), row_scales, packed, scales, comp, torch.float32)
    with pytest.raises(RuntimeError, match="one float32 per token"):
        gemm(xu, row_scales[:2], packed, scales, comp, torch.float32)
    with pytest.raises(RuntimeError, match="uint8"):
        gemm(xu.to(torch.int8), row_scales, packed, scales, comp, torch.float32)


@pytest.mark.skipif(not amx_int8_gemm(), reason="this CPU has no AMX")
def test_amx_kernels_leave_pytorchs_own_amx_users_correct():
    # Our kernels load and release the tile configuration on every thread they run on; PyTorch's bf16
    # flash attention (prompt steps) and oneDNN (the bf16 head) configure tiles their own way. Interleaved
    # on the same threads, each must still compute exactly what it computes alone.
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 9, 64, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    head_x, head_w = torch.randn(32, 576, generator=gen).bfloat16(), torch.randn(4096, 576, generator=gen).bfloat16()

    def pytorch_amx_users():
        return (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                torch.nn.functional.linear(head_x, head_w))

    alone = pytorch_amx_users()
    qw, scales, xu, row_scales = _case(32, 960, 576)
    packed, comp = pack_int8_for_amx(qw)
    cache = torch.randn(8, 3, 16, 64, generator=gen).bfloat16()
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    for _ in range(3):
        torch.ops.llmserve.int8_gemm(xu, row_scales, packed, scales, comp, torch.bfloat16)
        torch.ops.llmserve.paged_decode_attention(torch.randn(2, 9, 64).bfloat16(), cache, cache, table,
                                                  torch.tensor([50, 64], dtype=torch.int32), 0.125)
        after = pytorch_amx_users()
        assert all(torch.equal(a, b) for a, b in zip(alone, after, strict=True))
