"""int4 groups of any size: round to nearest within half a step, and the exact per-32 form our kernels take."""

from __future__ import annotations

import pytest
import torch

from llmserve.quantization.int4_groups import Int4Groups, check_group_size, fit_groups
from llmserve.quantization.weight_only import WeightOnlyLinear


@pytest.mark.parametrize("group_size", [32, 128])
def test_round_to_nearest_is_within_half_a_step(group_size):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    g = fit_groups(w, group_size)
    assert g.q.dtype == torch.int32 and int(g.q.min()) >= 0 and int(g.q.max()) <= 15
    assert int(g.zeros.min()) >= 0 and int(g.zeros.max()) <= 15
    assert torch.equal(g.scales, g.scales.half().float())  # fp16 values, as AWQ's files hold them
    step = g.scales.repeat_interleave(group_size, dim=-1)
    # half a step, plus the zero point's rounding at the group's ends (z = -round(min / s))
    assert ((g.dequantize() - w).abs() <= step + 1e-7).all()
    assert ((g.dequantize() - w).abs() <= step / 2 + 1e-7).float().mean() > 0.95


def test_group_128_runs_on_the_kernels_groups_of_32():
    torch.manual_seed(1)
    w = torch.randn(32, 256) * 0.05
    g = fit_groups(w, 128)
    scale, low = g.grid32()
    assert scale.shape == low.shape == (32, 8)
    assert torch.equal(scale[:, 0], scale[:, 3]) and torch.equal(scale[:, 4], scale[:, 7])
    # our int4 layer on that grid holds the same levels (min rounded to fp16: at most 15 * 2^-11 of a step)
    layer = WeightOnlyLinear(g.dequantize(), "int4", grid=(scale, low))
    step = g.scales.repeat_interleave(128, dim=-1)
    err = (layer.weight - g.dequantize()).abs() / step
    assert err.max() <= 15 * 2**-11
    assert not torch.equal(fit_groups(w, 32).dequantize(), g.dequantize())  # 32 is a finer grid than 128


def test_rows_split_a_fused_weight():
    g = fit_groups(torch.randn(40, 64), 32)
    top, bottom = g.rows(0, 16), g.rows(16, 40)
    assert isinstance(top, Int4Groups) and torch.equal(torch.cat([top.dequantize(), bottom.dequantize()]),
                                                       g.dequantize())


@pytest.mark.parametrize("bad", [0, 16, 48, 100])
def test_group_sizes_that_are_not_multiples_of_32_are_refused(bad):
    with pytest.raises(ValueError, match="multiple of 32"):
        check_group_size(bad)
    with pytest.raises(ValueError, match="does not divide"):
        check_group_size(128, 96)
