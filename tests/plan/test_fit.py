"""Fitting the step model to bench results: a server whose step time is known is recovered from its levels."""

from __future__ import annotations

import statistics

import pytest

from llmserve.plan.fit import fit_step_model
from llmserve.plan.simulator import SchedulerLimits, ServerLatency, simulate
from llmserve.plan.step_model import LinearStepModel
from llmserve.plan.traffic import SimRequest

from .helpers import synthetic_bench, synthetic_rate_level


@pytest.mark.parametrize("records", [False, True])
def test_recovers_a_linear_step_model(records: bool) -> None:
    # Mean TPOT is exactly linear in the coefficients and the median gap is the median plain decode step.
    true = LinearStepModel(0.010, 0.002, 0.0002)
    fit = fit_step_model([synthetic_bench(true, 200, 64, (1, 2, 4, 8, 16, 32), records=records)])
    assert fit.model.overhead_s == pytest.approx(true.overhead_s, rel=0.02)
    assert fit.model.per_decode_row_s == pytest.approx(true.per_decode_row_s, rel=0.02)
    assert fit.model.per_prefill_token_s == pytest.approx(true.per_prefill_token_s, rel=0.02)
    assert fit.model.per_attention_pair_s == 0.0
    assert fit.columns == ["overhead_s", "per_decode_row_s", "per_prefill_token_s"]
    assert {o.source.split()[0] for o in fit.observations} == {"TPOT", "ITL"}
    assert all(abs(d["error"]) < 0.02 for d in fit.describe()["observations"])
    # TTFT at c=1 is all engine here: no front-end latency is left over
    measured, engine = fit.ttft_c1
    assert engine == pytest.approx(measured, rel=0.02) and fit.latency.front_end_s < 0.02 * measured
    assert fit.latency.wake_s == 0.0 and fit.wake_samples == 0  # no request-rate level: nothing to see it in


def test_front_end_latency_is_what_ttft_at_one_has_beyond_the_engine() -> None:
    true = LinearStepModel(0.010, 0.002, 0.0002)
    doc = synthetic_bench(true, 200, 64, (1, 4, 16))
    for level in doc["levels"]:  # a front end that takes 30 ms before the engine sees each request
        level["summary"]["ttft_mean_ms"] += 30.0
    fit = fit_step_model([doc])
    assert fit.latency.front_end_s == pytest.approx(0.030, abs=0.002)
    assert fit.model.per_prefill_token_s == pytest.approx(0.0002, rel=0.02)  # the engine is not blamed


def _ttft_at_one(model: LinearStepModel, prompt: int, front_end_s: float) -> float:
    return statistics.fmean(simulate([SimRequest(0.0, prompt, 64)] * 8, model, SchedulerLimits(), closed_loop=1).ttft) \
        + front_end_s


def test_two_prompt_lengths_at_one_tell_the_front_end_from_the_prompt_cost() -> None:
    # Decode steps as the linear model says, but prompt tokens dearer in the steps that carry them (as eager
    # prompt steps are beside a compiled decode): the TPOT levels barely see it, TTFT at c=1 shows it all.
    decode = LinearStepModel(0.010, 0.002, 0.0002)
    prompts = LinearStepModel(0.010, 0.002, 0.0003)
    sweep = synthetic_bench(decode, 200, 64, (1, 4, 16))
    long = synthetic_bench(decode, 800, 64, (1,))
    for doc, prompt in ((sweep, 200), (long, 800)):  # c=1's TTFT: the dear prompt and a 30 ms front end
        doc["levels"][0]["summary"]["ttft_mean_ms"] = _ttft_at_one(prompts, prompt, 0.030) * 1e3
    residual = fit_step_model([sweep])  # one prompt length: the front end is what TTFT has beyond the engine
    assert "front_end_s" not in residual.columns and not [o for o in residual.observations if o.front_end]
    assert residual.latency.front_end_s > 0.045  # the dear prompt's 20 ms taken for front end
    joint = fit_step_model([sweep, long])
    assert joint.columns[-1] == "front_end_s"
    assert {o.prompt_len for o in joint.observations if o.front_end} == {200.0, 800.0}
    for prompt, rel in ((800, 0.02), (500, 0.06)):  # the joint fit follows TTFT over prompt length
        true = _ttft_at_one(prompts, prompt, 0.030)
        assert _ttft_at_one(joint.model, prompt, joint.latency.front_end_s) == pytest.approx(true, rel=rel)
    assert _ttft_at_one(residual.model, 800, residual.latency.front_end_s) < 0.85 * _ttft_at_one(prompts, 800, 0.030)


def test_wake_up_after_idle_is_fitted_from_a_light_request_rate_level() -> None:
    true = LinearStepModel(0.010, 0.002, 0.0002)
    server = ServerLatency(front_end_s=0.0, wake_s=0.025)
    sweep = synthetic_bench(true, 200, 64, (1, 4, 16))  # closed loops never idle: no wake-up in them
    light = synthetic_rate_level(true, server, 200, 64, rate=0.5, n=60)
    fit = fit_step_model([sweep, light])
    assert fit.latency.wake_s == pytest.approx(0.025, abs=0.001)
    assert 30 <= fit.wake_samples <= 60  # most of a light load's requests find the engine idle
    assert fit.model.per_prefill_token_s == pytest.approx(0.0002, rel=0.02)  # the steps are fitted as before
    assert fit.describe()["wake_s"] == fit.latency.wake_s
    # a server that does not slow down after idle gets none
    plain = fit_step_model([sweep, synthetic_rate_level(true, ServerLatency(), 200, 64, rate=0.5, n=60)])
    assert plain.latency.wake_s == pytest.approx(0.0, abs=1e-9)


def test_median_gap_counts_as_a_plain_decode_step_where_prompts_are_rare() -> None:
    true = LinearStepModel(0.004, 0.0015, 0.0003)
    fit = fit_step_model([synthetic_bench(true, 32, 64, (1, 4, 16))])
    itl = {o.source.split()[2]: o for o in fit.observations if o.source.startswith("ITL")}
    assert set(itl) == {"c=1", "c=4", "c=16"}
    assert itl["c=16"].features[1] == pytest.approx(16, rel=0.1)  # about 16 rows, no prompt tokens
    assert itl["c=16"].features[2] == 0.0
    assert fit.model.per_decode_row_s == pytest.approx(0.0015, rel=0.03)
    # long prompts make most steps of a stream carry some: then the median gap says nothing plain
    busy = fit_step_model([synthetic_bench(true, 2000, 8, (1, 4, 16))])
    assert not [o for o in busy.observations if o.source.startswith("ITL") and "c=16" in o.source]


def test_attention_cost_needs_two_prompt_lengths() -> None:
    true = LinearStepModel(0.010, 0.002, 0.0002, 1e-7)
    one = fit_step_model([synthetic_bench(true, 200, 64, (1, 4, 16))])
    assert "per_attention_pair_s" not in one.columns  # indistinguishable from the per-row cost here
    assert max(abs(p / o.seconds - 1) for o, p in zip(one.observations, one.predicted, strict=True)) < 0.02
    two = fit_step_model([synthetic_bench(true, 100, 64, (1, 4, 16)), synthetic_bench(true, 800, 64, (1, 4, 16))])
    assert two.model.per_attention_pair_s == pytest.approx(1e-7, rel=0.1)
    assert two.model.per_decode_row_s == pytest.approx(0.002, rel=0.05)


def test_fit_uses_the_scheduler_limits_of_the_measured_server() -> None:
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=128, chunk=64)
    true = LinearStepModel(0.005, 0.003, 0.0001)
    doc = synthetic_bench(true, 300, 32, (1, 4, 8), limits=limits)
    assert fit_step_model([doc], limits).model.per_prefill_token_s == pytest.approx(0.0001, rel=0.02)
    assert fit_step_model([doc]).model.per_prefill_token_s != pytest.approx(0.0001, rel=0.1)  # other limits: wrong


def test_one_level_is_not_enough() -> None:
    doc = synthetic_bench(LinearStepModel(0.01, 0.001, 0.0001), 100, 16, (4,))
    with pytest.raises(ValueError, match="two or more concurrencies"):
        fit_step_model([doc])
