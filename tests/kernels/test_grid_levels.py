"""`grid_levels.cpp` gives the levels and values PyTorch's ops give (`weight_only.py`'s two paths), bit for bit: on
random grids, fitted ones, ties, zero scales, weights rounded to bfloat16, and the real files' Q4_1, Q4_K, Q6_K, Q5_0
and Q8_0 tensors."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import load_cpu_kernels
from llmserve.loader.gguf import _dense, int4_grid, int8_grid, read_tensors
from llmserve.quantization.methods.int4 import quantize_int4
from llmserve.quantization.methods.int8 import grouped_levels, int6_levels
from tests.model_files import gguf_files


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


def assert_same_int4(w: torch.Tensor, grid) -> None:
    ref = quantize_int4(w, grid, native=False)
    got = quantize_int4(w, grid, native=True)
    assert got.q.dtype == torch.uint8 and torch.equal(got.q.int(), ref.q)
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.lo, ref.lo)
    assert got.dequantized.dtype == w.dtype and torch.equal(got.dequantized, ref.dequantized.to(w.dtype))
    assert (got.blocks is None) == (ref.blocks is None)


def assert_same_int6(w: torch.Tensor, grid) -> bool:
    """Both paths agree on a Q6_K grid; returns whether the grid gives the weight."""
    return _assert_same_levels(int6_levels, w, grid, ("q", "d", "sc"))


def assert_same_grouped(w: torch.Tensor, grid) -> bool:
    """Both paths agree on a Q8_0 / Q5_0 grid (d per 32 inputs); returns whether the grid gives the weight."""
    return _assert_same_levels(grouped_levels, w, grid, ("q", "d"))


def _assert_same_levels(levels_of, w: torch.Tensor, grid, fields: tuple[str, ...]) -> bool:
    ref, got = levels_of(w, grid, native=False), levels_of(w, grid, native=True)
    assert (got is None) == (ref is None)
    if ref is None:
        return False
    assert got.q.dtype == torch.uint8 and all(torch.equal(getattr(got, f), getattr(ref, f)) for f in fields)
    assert got.dequantized.dtype == w.dtype and torch.equal(got.dequantized, ref.dequantized.to(w.dtype))
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_levels_on_a_grid_with_ties_and_zero_scales(dtype):
    gen = torch.Generator().manual_seed(1)
    out, inp = 48, 512
    scale = (torch.rand(out, inp // 32, generator=gen) * 0.02 + 1e-3).half().float()
    lo = (-torch.rand(out, inp // 32, generator=gen) * 0.2).half().float()
    scale[0, :3] = 0  # one level: the step is 1
    levels = torch.randint(0, 16, (out, inp // 32, 32), generator=gen).float()
    w = levels * scale[..., None] + lo[..., None]
    w[1:3] += (torch.rand(2, inp // 32, 32, generator=gen) - 0.5) * scale[1:3, :, None] * 1.2  # off the grid
    w[3, :4] += 0.5 * scale[3, :4, None]  # halfway between two levels: ties round to even
    w[4] = w[4] * 9 - 3  # beyond both ends: clamped
    assert_same_int4(w.view(out, inp).to(dtype), (scale, lo))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_levels_on_a_fitted_grid(dtype):
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2)).to(dtype)
    w[5, :32] = 0.25  # a constant group: the smallest step
    assert_same_int4(w, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int6_levels_on_a_grid_and_off_it(dtype):
    gen = torch.Generator().manual_seed(3)
    out, inp = 32, 512
    d = (torch.rand(out, inp // 256, generator=gen) * 1e-3 + 1e-4).half().float()
    sc = torch.randint(-128, 128, (out, inp // 16), generator=gen, dtype=torch.int8)
    sc[0, :2] = 0
    levels = torch.randint(-32, 32, (out, inp // 16, 16), generator=gen).float()
    scale = d.repeat_interleave(16, dim=1) * sc.float()
    w = (levels * scale[..., None]).view(out, inp).to(dtype)
    assert assert_same_int6(w, (d, sc))
    changed = w.clone()
    changed[7, 9] += float(changed[7].abs().max()) / 5
    assert not assert_same_int6(changed, (d, sc))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lowest, highest", [(-128, 127), (-16, 15)])  # Q8_0's integers, Q5_0's
def test_grouped_levels_on_a_grid_and_off_it(dtype, lowest, highest):
    gen = torch.Generator().manual_seed(4)
    out, inp = 32, 256
    d = (torch.rand(out, inp // 32, generator=gen) * 1e-2 + 1e-4).half().float()
    d[0, :2] = 0  # an all-zero group
    levels = torch.randint(lowest, highest + 1, (out, inp // 32, 32), generator=gen).float()
    levels[1, 0, :2] = torch.tensor([-128.0, 127.0])  # int8's two ends
    w = (levels * d[..., None]).view(out, inp).to(dtype)
    assert assert_same_grouped(w, (d,))
    got = grouped_levels(w, (d,), native=True)
    assert torch.equal(got.q.int() - 128, levels.view(out, inp).int().where(d.repeat_interleave(32, 1) != 0, 0))
    changed = w.clone()
    changed[5, 40] = 0.4 * float(d[5, 1])  # 0.4 of a level: off the grid
    assert not assert_same_grouped(changed, (d,))


def test_the_values_are_the_weight_or_a_copy_of_a_run_of_its_rows():
    """The native op checks the values instead of writing them: a whole weight's are the weight itself; a run of a
    fused weight's rows (a view) gets a copy of its own, so the layer does not keep the whole weight alive."""
    gen = torch.Generator().manual_seed(5)
    d = (torch.rand(64, 8, generator=gen) * 1e-2 + 1e-4).half().float()
    w = (torch.randint(-128, 128, (64, 8, 32), generator=gen).float() * d[..., None]).view(64, 256).bfloat16()
    whole = grouped_levels(w, (d,), native=True)
    assert whole.dequantized.data_ptr() == w.data_ptr()
    part = grouped_levels(w[16:48], (d[16:48],), native=True)
    assert torch.equal(part.dequantized, w[16:48]) and part.dequantized.untyped_storage().nbytes() == 32 * 256 * 2


@pytest.mark.parametrize("path", gguf_files())
def test_the_files_tensors_give_the_same_levels(path):
    """The first and last tensor of each 4-bit and int8-held type in the file, as the model holds them (bfloat16)."""
    tensors = [t for t in read_tensors(path) if len(t.shape) == 2]
    checked = set()
    for type_name, read_grid, check in (("Q4_1", int4_grid, assert_same_int4), ("Q4_K", int4_grid, assert_same_int4),
                                        ("Q6_K", int8_grid, assert_same_int6), ("Q8_0", int8_grid, assert_same_grouped),
                                        ("Q5_0", int8_grid, assert_same_grouped)):
        of_type = [t for t in tensors if t.tensor_type.name == type_name]
        for tensor in of_type[:1] + of_type[-1:]:
            grid = tuple(torch.from_numpy(g.copy()) for g in read_grid(tensor))
            if check(_dense(tensor).to(torch.bfloat16), grid) is not False:
                checked.add(type_name)
    assert checked, "no 4-bit or int8-held tensor in the file"


def test_bad_inputs_raise():
    w, grid = torch.randn(4, 64), torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.llmserve.int4_levels(w.half(), grid, grid, grid, grid)
    with pytest.raises(RuntimeError, match=r"contiguous float32 \[out, in / 32\]"):
        torch.ops.llmserve.int4_levels(w, torch.ones(4, 3), grid, grid, grid)
    with pytest.raises(RuntimeError, match="the runs dividing in_features"):
        torch.ops.llmserve.signed_levels(torch.randn(4, 40), torch.ones(4, 3), -32, 31)
    with pytest.raises(RuntimeError, match="at most 256 integers"):
        torch.ops.llmserve.signed_levels(w, grid, -128, 128)
