"""The fused elementwise kernels against the PyTorch ops they replace, on the same inputs, and against
the exact value (float64 from the same inputs).

They compute in float32 and round once at the end, where eager PyTorch rounds to bfloat16 after each op:
in bfloat16 they agree with eager to its rounding and are correctly rounded themselves (the exact value's
nearest bfloat16, but for a float32 rounding error landing on a tie)."""

import pytest
import torch
from torch import nn

from llmserve.kernels import load_cpu_kernels
from llmserve.layers.layernorm import RMSNorm
from llmserve.layers.rotary_embedding import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="native kernels unavailable (no compiler)")

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor, rounded_share: float = 0.99) -> None:
    """`expected`: PyTorch's result; `exact`: float64 from the same inputs; `rounded_share`: of bfloat16 values
    the exact value's nearest, at least."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])
    if actual.dtype == torch.bfloat16:
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs() + 1e-30  # (silu(-100): e^-x clamped at e^88)
        assert ((actual.double() - exact).abs() <= ulp).all(), "more than one bfloat16 step from the exact value"
        rounded = (actual == exact.to(torch.bfloat16)).double().mean().item()
        assert rounded > rounded_share, f"only {rounded:.1%} correctly rounded"
    else:
        torch.testing.assert_close(actual.double(), exact, rtol=1e-5, atol=1e-6)


def _rms_exact(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 85, 300])
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a width that is no multiple of the vector length
def test_rms_norm_and_add(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(tokens * hidden)
    norm, native = RMSNorm(hidden, 1e-5).to(dtype), RMSNorm(hidden, 1e-5, native=True).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
        native.weight.copy_(norm.weight)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(tokens, hidden, generator=g).to(dtype)
    with torch.no_grad():
        _close(native(x), norm(x), _rms_exact(x, norm.weight, 1e-5))
        total, normed = native.add_forward(x, delta)
        ref_total, ref_normed = norm.add_forward(x, delta)
    assert torch.equal(total, ref_total)  # one rounded add either way: the residual stream is unchanged
    _close(normed, ref_normed, _rms_exact(total, norm.weight, 1e-5))


def test_rms_norm_reads_strided_rows() -> None:
    x = torch.randn(5, 2 * 64)[:, :64]  # rows 128 apart
    w = torch.rand(64)
    assert torch.equal(torch.ops.llmserve.rms_norm(x, w, 1e-6), torch.ops.llmserve.rms_norm(x.contiguous(), w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_norm_and_norms_over_heads(dtype: torch.dtype) -> None:
    """Gemma's norms scale by 1 + w (the one added in float32, as its reference adds it); a query/key norm reads each
    head of the fused q/k/v projection's columns, rows wider than the heads."""
    g = torch.Generator().manual_seed(7)
    tokens, heads, head_dim = 9, 6, 32
    norm = RMSNorm(head_dim, 1e-6, unit_offset=True).to(dtype)
    native = RMSNorm(head_dim, 1e-6, native=True, unit_offset=True).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(head_dim, generator=g) * 0.5)
        native.weight.copy_(norm.weight)
    qkv = (torch.randn(tokens, (heads + 2) * head_dim, generator=g) * 3).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    exact = _rms_exact(q, 1.0 + norm.weight.double(), 1e-6)
    with torch.no_grad():
        out = native(q)
        _close(out, norm(q), exact)
        assert out.is_contiguous() and torch.equal(out, native(q.contiguous()))
        rows = q.reshape(-1, head_dim)
        delta = torch.randn_like(rows)
        total, normed = native.add_forward(rows, delta)
        _close(normed, norm.add_forward(rows, delta)[1], _rms_exact(total, 1.0 + norm.weight.double(), 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: half of it is no multiple of 16, the scalar loop
def test_rotary_on_the_fused_projection(dtype: torch.dtype, head_dim: int) -> None:
    # q and k heads as the fused qkv projection leaves them: rows wider than q + k (v follows)
    tokens, heads, kv_heads = 33, 9, 3
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    rotary = RotaryEmbedding(head_dim, 2048, 10000.0)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    cos, sin = rotary.lookup(positions, dtype)
    exact = qk.double() * cos.double() + qk.double().roll(head_dim // 2, dims=-1) * sin.double()
    _close(apply_rotary(qk, cos, sin, native=True), apply_rotary(qk, cos, sin), exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 85])
def test_silu_and_mul(dtype: torch.dtype, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * 1536, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped ends and zero
    gate, up = gate_up.split(1536, dim=-1)
    exact = nn.functional.silu(gate.double()) * up.double()
    _close(torch.ops.llmserve.silu_and_mul(gate_up), nn.functional.silu(gate) * up, exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 85])
def test_gelu_tanh_and_mul(dtype: torch.dtype, tokens: int) -> None:
    """Gemma's gate: the activation rounded to the model's dtype, then the product, as its reference's two ops. The
    exact value in float64 as x * sigmoid(2u), the kernel's form of x (1 + tanh(u)) / 2: below x = -6 the tanh form
    rounds 1 + tanh(u) to 0 (PyTorch's gives -0.0 there, the kernel the tail, ~1e-15 and less)."""
    g = torch.Generator().manual_seed(tokens)
    width = 1000  # no multiple of the vector length
    gate_up = (torch.randn(tokens, 2 * width, generator=g) * 4).to(dtype)
    gate_up[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-3])  # exp's clamped ends, zero, near zero
    gate, up = gate_up.split(width, dim=-1)
    x = gate.double()
    gelu = x * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3))
    exact = gelu.to(dtype).double() * up.double()
    # rounded twice (the activation, then the product): an activation a float32 step off near a bfloat16 tie moves
    # the product one step, ~1 value in 100 here
    _close(torch.ops.llmserve.gelu_tanh_and_mul(gate_up), nn.functional.gelu(gate, approximate="tanh") * up, exact,
           rounded_share=0.98)


def test_bad_inputs_raise() -> None:
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.llmserve.rms_norm(torch.ones(2, 4, dtype=torch.float16), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="one weight per feature"):
        torch.ops.llmserve.rms_norm(torch.ones(2, 4), torch.ones(3), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* features"):
        torch.ops.llmserve.silu_and_mul(torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="2 \\* features"):
        torch.ops.llmserve.gelu_tanh_and_mul(torch.ones(2, 5))
    with pytest.raises(RuntimeError, match="heads contiguous"):  # heads 16 apart, each 8 wide
        torch.ops.llmserve.rms_norm(torch.ones(2, 3, 16)[:, :, :8], torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="one cos and sin row per token"):
        torch.ops.llmserve.rotary(torch.ones(3, 2, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 49152), (32, 49152), (3, 7), (5, 33)])
def test_argmax_rows_is_torch_argmax(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(shape[0] * shape[1])
    logits = torch.randn(shape, generator=g).to(dtype)  # bfloat16: many ties among 49152 values
    logits[0, :] = float("-inf")  # all -inf: index 0, as torch
    if shape[0] > 1:
        logits[1, 3] = logits[1, shape[1] - 2] = 1e9  # ties: the first maximum
    if shape[0] > 2:
        logits[2, -1] = float("inf")  # in the scalar tail
    tokens = torch.ops.llmserve.argmax_rows(logits)
    assert torch.equal(tokens, logits.float().argmax(dim=-1))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.llmserve.argmax_rows(logits.double())
