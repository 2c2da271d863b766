"""The native quantized products: the vector loops equal the portable ones and the product of the
dequantized weights (what PyTorch's kernels and the large-step path compute), for every token count
and both activation dtypes; bad inputs raise."""

from __future__ import annotations

import pytest
import torch

from llmserve.evaluate.reference import q8_0_levels
from llmserve.host import cpu_flags
from llmserve.kernels import load_cpu_kernels, native_quantized_kernels
from llmserve.kernels.quantized_gemv import pack_int4, pack_int8


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _int4_case(out_features, in_features, seed=0, mins_only=False):
    """(packed weight, dense weight); `mins_only`: the dense weight's minimums' part alone, [out, in] float64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=gen)
    scales = (torch.rand(out_features, in_features // 32, generator=gen) * 0.01).half().float()
    mins = (-torch.rand(out_features, in_features // 32, generator=gen) * 0.05).half().float()
    if mins_only:
        return mins.double().repeat_interleave(32, dim=1)
    dense = (q.float().view(out_features, -1, 32) * scales[..., None] + mins[..., None]).view(out_features, in_features)
    return pack_int4(q, scales, mins), dense


def _int8_case(out_features, in_features, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen).to(torch.int8)
    scales = torch.rand(out_features, generator=gen) * 0.01
    return pack_int8(q), scales, q.float() * scales[:, None]


def _assert_same_up_to_summation_order(out, portable):
    """float32 sums in another order: a few float32 ulps, or one bfloat16 ulp once rounded to bfloat16."""
    rtol = 1e-5 if out.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, portable, rtol=rtol, atol=1e-5 * float(portable.abs().max()))


# 1-8 tokens: one pass (from 5 the int4 loop keeps one dependency chain per token and part, not two); 9 and
# 17: passes of 8 plus a remainder. Shapes: SmolLM2's, and small ones.
TOKENS = [1, 2, 3, 5, 8, 9, 17]
SHAPES = [(960, 576), (576, 1536), (32, 64)]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_product_equals_the_dequantized_weight(tokens, shape, dtype):
    packed, dense = _int4_case(*shape)
    x = torch.randn(tokens, shape[1]).to(dtype)
    out = torch.ops.llmserve.int4_gemv(x, packed, shape[0])
    assert out.dtype == dtype and out.shape == (tokens, shape[0])
    expected = x.double() @ dense.double().T
    # float32: only the ~16-bit activation split rounds; bfloat16: the output's own rounding
    tol = 1e-4 * expected.abs().max() if dtype == torch.float32 else 8e-3 * expected.abs().max()
    assert (out.double() - expected).abs().max() < tol
    portable = torch.ops.llmserve.int4_gemv_portable(x, packed, shape[0])
    _assert_same_up_to_summation_order(out, portable)


# 33: past Q8_MAX_TOKENS' 32; (2048, 1536): several 256 KiB tiles of row blocks per thread, passed over once per
# 8 tokens (Qwen2.5-Coder-1.5B's q/k/v)
@pytest.mark.parametrize("tokens", [*TOKENS, 32, 33])
@pytest.mark.parametrize("shape", [*SHAPES, (2048, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_product_of_q8_inputs_is_exact_on_their_levels(tokens, shape, dtype):
    """One activation part: x's Q8_0 levels times q * scale, plus x itself times the minimums (the kernel sums each
    group's inputs exactly for that term), up to float32 sums."""
    packed, dense = _int4_case(*shape)
    mins = _int4_case(*shape, mins_only=True)
    x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens)).to(dtype)  # see int8's
    out = torch.ops.llmserve.int4_gemv(x, packed, shape[0], 1)
    assert out.dtype == dtype and out.shape == (tokens, shape[0])
    expected = q8_0_levels(x).double() @ (dense.double() - mins).T + x.double() @ mins.T
    tol = 2e-6 * expected.abs().max() if dtype == torch.float32 else 8e-3 * expected.abs().max()
    assert (out.double() - expected).abs().max() < tol
    # and not the ~16-bit product: the levels are what it computes with
    assert (out.double() - x.double() @ dense.double().T).abs().max() > 10 * tol or dtype == torch.bfloat16
    portable = torch.ops.llmserve.int4_gemv_portable(x, packed, shape[0], 1)
    _assert_same_up_to_summation_order(out, portable)
    alone = torch.ops.llmserve.int4_gemv(x[-1:], packed, shape[0], 1)
    assert torch.equal(out[-1:], alone), "a token's result must not depend on the others in its step"


def test_activation_parts_are_one_or_two():
    packed, _ = _int4_case(64, 64)
    with pytest.raises(RuntimeError, match="activation_parts"):
        torch.ops.llmserve.int4_gemv(torch.randn(1, 64), packed, 64, 3)
    packed8, scales, _ = _int8_case(32, 64)
    with pytest.raises(RuntimeError, match="activation_parts"):
        torch.ops.llmserve.int8_gemv(torch.randn(1, 64), packed8, scales, 32, 0)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_equals_the_dequantized_weight(tokens, shape, dtype):
    packed, scales, dense = _int8_case(*shape)
    x = torch.randn(tokens, shape[1]).to(dtype)
    out = torch.ops.llmserve.int8_gemv(x, packed, scales, shape[0])
    assert out.dtype == dtype and out.shape == (tokens, shape[0])
    expected = x.double() @ dense.double().T
    # float32: only the ~16-bit activation split rounds (as int4's); bfloat16: the output's own rounding
    tol = 1e-4 * expected.abs().max() if dtype == torch.float32 else 8e-3 * expected.abs().max()
    assert (out.double() - expected).abs().max() < tol
    portable = torch.ops.llmserve.int8_gemv_portable(x, packed, scales, shape[0])
    _assert_same_up_to_summation_order(out, portable)


@pytest.mark.parametrize("tokens", [*TOKENS, 33])
@pytest.mark.parametrize("shape", [*SHAPES, (2048, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_of_q8_inputs_is_exact_on_their_levels(tokens, shape, dtype):
    """One activation part: x's Q8_0 levels times the int8 weight, up to float32 sums. The weights are stored as
    q + 128 and the 128 taken back out per group in integers: an error there would show as a whole offset."""
    packed, scales, dense = _int8_case(*shape)
    # seeded: the kernel's step (max|x| / 127 under -ffast-math) can differ from float32 division in its last
    # bit, and an input within that of a rounding boundary moves a whole level (one input in ~60 such x)
    x = torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens)).to(dtype)
    out = torch.ops.llmserve.int8_gemv(x, packed, scales, shape[0], 1)
    expected = q8_0_levels(x).double() @ dense.double().T
    tol = 2e-6 * expected.abs().max() if dtype == torch.float32 else 8e-3 * expected.abs().max()
    assert (out.double() - expected).abs().max() < tol
    assert (out.double() - x.double() @ dense.double().T).abs().max() > 10 * tol or dtype == torch.bfloat16
    for parts in (1, 2):
        _assert_same_up_to_summation_order(torch.ops.llmserve.int8_gemv(x, packed, scales, shape[0], parts),
                                           torch.ops.llmserve.int8_gemv_portable(x, packed, scales, shape[0], parts))
    alone = torch.ops.llmserve.int8_gemv(x[-1:], packed, scales, shape[0], 1)
    assert torch.equal(out[-1:], alone), "a token's result must not depend on the others in its step"


@pytest.mark.parametrize("weight", [127, -127])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int8_sums_hold_at_the_extremes(weight, sign):
    # every weight at +-127 (stored as 255 or 1) and every activation part at +-127: the AVX2 loop's int16
    # products (254 hi + lo) and int32 pair sums reach their bounds
    q = torch.full((32, 256), weight, dtype=torch.int8)
    scales = torch.full((32,), 0.01)
    x = torch.full((2, 256), sign * 3.0)
    for parts in (1, 2):
        out = torch.ops.llmserve.int8_gemv(x, pack_int8(q), scales, 32, parts)
        torch.testing.assert_close(out, torch.full((2, 32), sign * 3.0 * weight * 0.01 * 256))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_sums_hold_at_the_extremes(sign):
    # every nibble 15 and every activation part at +-127: the AVX2 loop's int16 pair sums reach their bound
    q = torch.full((32, 64), 15)
    scales, mins = torch.full((32, 2), 0.01).half().float(), torch.zeros(32, 2)
    x = torch.full((2, 64), sign * 3.0)
    for parts in (1, 2):
        out = torch.ops.llmserve.int4_gemv(x, pack_int4(q, scales, mins), 32, parts)
        torch.testing.assert_close(out, torch.full((2, 32), sign * 3.0 * 15 * float(scales[0, 0]) * 64))


def test_non_contiguous_activations_are_read_as_their_values():
    packed, dense = _int4_case(64, 64)
    x = torch.randn(64, 3).T  # [3, 64], strided
    torch.testing.assert_close(torch.ops.llmserve.int4_gemv(x, packed, 64),
                               torch.ops.llmserve.int4_gemv(x.contiguous(), packed, 64))


def test_mismatched_shapes_raise_instead_of_reading_past_the_weight():
    packed, _ = _int4_case(64, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.llmserve.int4_gemv(torch.randn(1, 128), packed, 64)
    with pytest.raises(RuntimeError, match="multiple"):
        torch.ops.llmserve.int4_gemv(torch.randn(1, 48), packed, 64)
    packed8, scales, _ = _int8_case(32, 64)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.llmserve.int8_gemv(torch.randn(1, 64), packed8, scales, 48)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.llmserve.int8_gemv(torch.randn(1, 64).half(), packed8, scales, 32)


def test_packing_refuses_shapes_the_kernels_do_not_take():
    with pytest.raises(ValueError, match="out_features"):
        pack_int4(torch.zeros(24, 64, dtype=torch.int32), torch.ones(24, 2), torch.zeros(24, 2))
    with pytest.raises(ValueError, match="in_features"):
        pack_int4(torch.zeros(32, 48, dtype=torch.int32), torch.ones(32, 1), torch.zeros(32, 1))
    with pytest.raises(ValueError, match="out_features"):
        pack_int8(torch.zeros(24, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="in_features"):
        pack_int8(torch.zeros(32, 48, dtype=torch.int8))


def test_this_machine_runs_the_vector_loops():
    # AVX-512 VNNI hosts run the 16-lane loops, AVX2 ones (AMD Zen 1-3) the 8-lane ones; only a CPU with
    # neither keeps PyTorch's kernels for small steps
    assert native_quantized_kernels() == torch.ops.llmserve.quantized_gemv_vectorized()
    flags = cpu_flags()
    vector_isa = "avx512_vnni" in flags or {"avx2", "fma", "f16c"} <= flags
    assert torch.ops.llmserve.quantized_gemv_vectorized() == vector_isa
