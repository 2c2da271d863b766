"""The native quantized products: the vector loops equal the portable ones and the product of the
dequantized weights (what PyTorch's kernels and the large-step path compute), for every token count
and both activation dtypes; bad inputs raise."""

from __future__ import annotations

import pytest
import torch

from llmserve.evaluate.reference import q8_0_levels
from llmserve.host import cpu_flags
from llmserve.kernels import load_cpu_kernels, native_quantized_kernels
from llmserve.kernels.quantized_gemv import pack_int4, pack_int6, pack_int8, pack_int8_grouped, super_block_factors


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def _q4_k_grid(out_features, in_features, gen):
    """Q4_K's (scale, min) per group of 32: d * sc and -dmin * m per 256 inputs, d and dmin fp16, sc and m 6-bit with
    the largest 63 (as llama.cpp writes them), except in a few blocks (as an importance-weighted search may)."""
    supers = in_features // 256

    def factored(size):
        d = (torch.rand(out_features, supers, 1, generator=gen) * size / 63).half().float()
        u = torch.randint(0, 64, (out_features, supers, 8), generator=gen)
        u[..., 0] = 63
        u[::37, :, 0] = 40  # the largest 40 in some rows
        return (d * u).view(out_features, -1)

    return factored(0.01), -factored(0.05)


def _int4_case(out_features, in_features, seed=0, mins_only=False, layout="fp16"):
    """(packed weight, dense weight); `mins_only`: the dense weight's minimums' part alone, [out, in] float64.
    `layout`: "fp16" (scales and minimums any fp16 values) or "super" (a Q4_K grid, in the super-block layout)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=gen)
    if layout == "super":
        scales, mins = _q4_k_grid(out_features, in_features, gen)
    else:
        scales = (torch.rand(out_features, in_features // 32, generator=gen) * 0.01).half().float()
        mins = (-torch.rand(out_features, in_features // 32, generator=gen) * 0.05).half().float()
    if mins_only:
        return mins.double().repeat_interleave(32, dim=1)
    dense = (q.float().view(out_features, -1, 32) * scales[..., None] + mins[..., None]).view(out_features, in_features)
    packed = pack_int4(q, scales, mins)
    assert packed.numel() == out_features * in_features * (4.625 if layout == "super" else 5) / 8
    return packed, dense


def _int8_case(out_features, in_features, seed=0, layout="int8"):
    """(packed weight, row scales, dense weight). `layout`: "int8" (an int8 per weight), "six" (a Q6_K weight,
    w = d * sc * (q - 32) per 16 inputs, in the 6-bit layout) or "grouped" (a Q8_0 weight, w = d * q with an fp16 d
    per 32 inputs), each times row scales as any int8 weight."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(out_features, generator=gen) * 0.01
    if layout == "int8":
        q = torch.randint(-127, 128, (out_features, in_features), generator=gen).to(torch.int8)
        return pack_int8(q), scales, q.float() * scales[:, None]
    if layout == "grouped":
        q = torch.randint(-128, 128, (out_features, in_features), generator=gen).to(torch.int8)
        d = (torch.rand(out_features, in_features // 32, generator=gen) * 4).half().float()
        packed = pack_int8_grouped(q, d)
        assert packed.numel() == out_features * in_features * 8.5 / 8
        return packed, scales, q.float() * d.repeat_interleave(32, dim=1) * scales[:, None]
    q = torch.randint(0, 64, (out_features, in_features), generator=gen)
    d = (torch.rand(out_features, in_features // 256, generator=gen) * 0.02).half().float()
    sc = torch.randint(-128, 128, (out_features, in_features // 16), generator=gen).to(torch.int8)
    step = d.repeat_interleave(16, dim=1) * sc.float()  # per 16 inputs, exact in float32
    packed = pack_int6(q, d, sc)
    assert packed.numel() == out_features * in_features * 6.625 / 8
    dense = (step.repeat_interleave(16, dim=1) * (q - 32).float()) * scales[:, None]
    return packed, scales, dense


def _off_q8_ties(x):
    """x with every input that lies within 1e-3 of a step of a Q8_0 rounding tie moved to a quarter step past its
    level: the kernel's step (max|x| / 127 under -ffast-math) can differ from float32 division in its last bit, and
    an input that close to a tie then lands one level away from `q8_0_levels`' (seen once in ~60 random x)."""
    groups = x.reshape(x.shape[0], -1, 32)
    step = groups.abs().amax(dim=-1, keepdim=True) / 127
    scaled = groups / step
    tie = (scaled - scaled.floor() - 0.5).abs() < 1e-3
    return torch.where(tie, (scaled.floor() + 0.25) * step, groups).reshape(x.shape)


def _assert_same_up_to_summation_order(out, portable):
    """float32 sums in another order: a few float32 ulps, or one bfloat16 ulp once rounded to bfloat16."""
    rtol = 1e-5 if out.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, portable, rtol=rtol, atol=1e-5 * float(portable.abs().max()))


# 1-8 tokens: one pass (from 5 the int4 loop keeps one dependency chain per token and part, not two); 9 and
# 17: passes of 8 plus a remainder. Shapes: SmolLM2's, and small ones.
TOKENS = [1, 2, 3, 5, 8, 9, 17]
SHAPES = [(960, 576), (576, 1536), (32, 64)]


# the super-block layout takes inputs by 256: SmolLM2's down, a small shape, Qwen2.5-Coder-1.5B's down (35 blocks)
SUPER_SHAPES = [(576, 1536), (32, 256), (64, 8960)]
LAYOUT_SHAPES = [*[("fp16", shape) for shape in SHAPES], *[("super", shape) for shape in SUPER_SHAPES]]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("layout", "shape"), LAYOUT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_product_equals_the_dequantized_weight(tokens, layout, shape, dtype):
    packed, dense = _int4_case(*shape, layout=layout)
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
@pytest.mark.parametrize(("layout", "shape"), [*LAYOUT_SHAPES, ("fp16", (2048, 1536)), ("super", (2048, 1536))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_product_of_q8_inputs_is_exact_on_their_levels(tokens, layout, shape, dtype):
    """One activation part: x's Q8_0 levels times q * scale, plus x itself times the minimums (the kernel sums each
    group's inputs exactly for that term), up to float32 sums."""
    packed, dense = _int4_case(*shape, layout=layout)
    mins = _int4_case(*shape, mins_only=True, layout=layout)
    x = _off_q8_ties(torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens))).to(dtype)
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


# the int8 op's layouts: an int8 per weight, or Q6_K's 6 bits (inputs by 256)
INT8_LAYOUT_SHAPES = [*[(layout, shape) for layout in ("int8", "grouped") for shape in SHAPES],
                      *[("six", shape) for shape in SUPER_SHAPES]]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("layout", "shape"), INT8_LAYOUT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_equals_the_dequantized_weight(tokens, layout, shape, dtype):
    packed, scales, dense = _int8_case(*shape, layout=layout)
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
@pytest.mark.parametrize(("layout", "shape"), [*INT8_LAYOUT_SHAPES,
                                               *[(layout, (2048, 1536)) for layout in ("int8", "six", "grouped")]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_product_of_q8_inputs_is_exact_on_their_levels(tokens, layout, shape, dtype):
    """One activation part: x's Q8_0 levels times the int8 weight, up to float32 sums. The weights are stored as
    q + 128 (Q6_K's as q with w ~ q - 32) and the offset taken back out per group (per 16 inputs) in integers: an
    error there would show as a whole offset."""
    packed, scales, dense = _int8_case(*shape, layout=layout)
    x = _off_q8_ties(torch.randn(tokens, shape[1], generator=torch.Generator().manual_seed(tokens))).to(dtype)
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


@pytest.mark.parametrize("q", [127, -128])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_grouped_sums_hold_at_the_extremes(q, sign):
    # q at -128 or 127 (stored as 0 or 255) and every activation part at +-127, each group's own d (one of them 0)
    d = torch.tensor([0.5, 0.0, 2.0, 0.25, 1.0, 0.125, 4.0, 0.75]).repeat(32, 1)
    x = torch.full((2, 256), sign * 3.0)
    packed = pack_int8_grouped(torch.full((32, 256), q, dtype=torch.int8), d)
    for parts in (1, 2):
        out = torch.ops.llmserve.int8_gemv(x, packed, torch.ones(32), 32, parts)
        torch.testing.assert_close(out, torch.full((2, 32), sign * 3.0 * q * float(d[0].sum()) * 32))


@pytest.mark.parametrize(("q", "sc"), [(63, 127), (0, -128), (0, 127)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_six_bit_sums_hold_at_the_extremes(q, sc, sign):
    # q at 0 or 63 and every activation part at +-127: the AVX2 loop's int16 sums of two pairs (4 x 63 x 127)
    # reach their bound, and sc * (q - 32) its largest sizes
    d = torch.full((32, 1), 0.01).half().float()
    x = torch.full((2, 256), sign * 3.0)
    packed = pack_int6(torch.full((32, 256), q), d, torch.full((32, 16), sc, dtype=torch.int8))
    for parts in (1, 2):
        out = torch.ops.llmserve.int8_gemv(x, packed, torch.ones(32), 32, parts)
        torch.testing.assert_close(out, torch.full((2, 32), sign * 3.0 * (q - 32) * sc * float(d[0, 0]) * 256))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_sums_hold_at_the_extremes(sign):
    # every nibble 15 and every activation part at +-127: the AVX2 loop's int16 pair sums reach their bound
    q = torch.full((32, 64), 15)
    scales, mins = torch.full((32, 2), 0.01).half().float(), torch.zeros(32, 2)
    x = torch.full((2, 64), sign * 3.0)
    for parts in (1, 2):
        out = torch.ops.llmserve.int4_gemv(x, pack_int4(q, scales, mins), 32, parts)
        torch.testing.assert_close(out, torch.full((2, 32), sign * 3.0 * 15 * float(scales[0, 0]) * 64))


def test_super_block_factors_are_exact_or_none():
    gen = torch.Generator().manual_seed(0)
    scales, mins = _q4_k_grid(64, 512, gen)
    for values in (scales, mins):
        factor, u = super_block_factors(values)
        assert factor.dtype == torch.float16 and factor.shape == (64, 2) and u.dtype == torch.uint8
        assert torch.equal((factor.float().repeat_interleave(8, dim=1) * u.float()), values)
    # Q4_K's own: d where the largest integer is 63; found by the search where it is less (row 0)
    factor, u = super_block_factors(scales)
    assert int(u[1].max()) == 63 and int(u[0, :8].max()) < 63
    # a zero block, and values no 8-bit multiple of one fp16 factor gives
    assert torch.equal(super_block_factors(torch.zeros(16, 8))[1], torch.zeros(16, 8, dtype=torch.uint8))
    assert super_block_factors(torch.rand(64, 16, generator=gen).half().float()) is None
    assert super_block_factors(torch.tensor([[1.0, -1.0, 0, 0, 0, 0, 0, 0]])) is None  # signs differ
    assert super_block_factors(scales[:, :4]) is None  # not whole blocks of 256 inputs
    # a grid that factors packs in the super-block layout, and with a layer's fp16 values the other one
    q = torch.randint(0, 16, (64, 512), generator=gen)
    assert pack_int4(q, scales, mins).numel() == 64 * 512 * 4.625 / 8
    assert pack_int4(q, scales.half().float(), mins.half().float()).numel() == 64 * 512 * 5 / 8


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
    with pytest.raises(ValueError, match="out_features"):
        pack_int8_grouped(torch.zeros(24, 64, dtype=torch.int8), torch.ones(24, 2))


def test_this_machine_runs_the_vector_loops():
    # AVX-512 VNNI hosts run the 16-lane loops, AVX2 ones (AMD Zen 1-3) the 8-lane ones; only a CPU with
    # neither keeps PyTorch's kernels for small steps
    assert native_quantized_kernels() == torch.ops.llmserve.quantized_gemv_vectorized()
    flags = cpu_flags()
    vector_isa = "avx512_vnni" in flags or {"avx2", "fma", "f16c"} <= flags
    assert torch.ops.llmserve.quantized_gemv_vectorized() == vector_isa
