"""`pack_layouts.cpp` writes the bytes `pack_int4` and `pack_int6` build with PyTorch's ops, bit for bit: random
levels of every value, both int4 layouts (fp16 and super-block headers), and the shapes the models have."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import load_cpu_kernels
from llmserve.kernels.quantized_gemv import pack_int4, pack_int6, super_blocks


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"


@pytest.mark.parametrize("shape", [(16, 32), (48, 256), (96, 1536)])
@pytest.mark.parametrize("levels_dtype", [torch.uint8, torch.int32])
def test_int4_packing_is_the_same_bytes(shape, levels_dtype):
    gen = torch.Generator().manual_seed(shape[0] * shape[1])
    q = torch.randint(0, 16, shape, generator=gen).to(levels_dtype)
    groups = shape[1] // 32
    scales = torch.rand(shape[0], groups, generator=gen) + 0.1
    mins = -torch.rand(shape[0], groups, generator=gen)
    layouts = [None]
    if shape[1] % 256 == 0:  # a grid that factors per super-block (Q4_K's form)
        def factored_grid() -> torch.Tensor:  # an fp16 factor per 256 inputs times 6-bit integers, the largest 63
            d = torch.rand(shape[0], shape[1] // 256, 1, generator=gen).half().float()
            u = torch.randint(1, 64, (shape[0], shape[1] // 256, 8), generator=gen)
            u[..., 0] = 63
            return (d * u).view(shape[0], -1)

        scales, mins = factored_grid(), -factored_grid()
        blocks = super_blocks(scales, mins)
        assert blocks is not None
        layouts.append(blocks)
    for factored in layouts:
        native = pack_int4(q, scales, mins, factored, native=True)
        assert torch.equal(native, pack_int4(q, scales, mins, factored, native=False))


@pytest.mark.parametrize("shape", [(16, 256), (32, 1536)])
def test_int6_packing_is_the_same_bytes(shape):
    gen = torch.Generator().manual_seed(shape[1])
    q = torch.randint(0, 64, shape, generator=gen, dtype=torch.uint8)
    d = torch.rand(shape[0], shape[1] // 256, generator=gen)
    sc = torch.randint(-128, 128, (shape[0], shape[1] // 16), generator=gen, dtype=torch.int8)
    assert torch.equal(pack_int6(q, d, sc, native=True), pack_int6(q, d, sc, native=False))


def test_bad_levels_raise():
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        torch.ops.llmserve.int4_nibbles(torch.zeros(16, 32, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.llmserve.int6_group_bytes(torch.zeros(8, 32, dtype=torch.uint8))
