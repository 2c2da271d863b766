"""The simulator against queueing theory and against step-by-step hand computation."""

from __future__ import annotations

import statistics

import pytest

from llmserve.plan.simulator import SchedulerLimits, ServerLatency, simulate
from llmserve.plan.step_model import LinearStepModel
from llmserve.plan.traffic import LengthDist, SimRequest, draw_requests


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait_matches_pollaczek_khinchine(rho: float) -> None:
    # One-token prompts and outputs, one request per step, each step a fixed D: every request is one
    # deterministic job on one server, so with Poisson arrivals the queue is M/D/1.
    service = 0.1
    model = LinearStepModel(overhead_s=0.0, per_decode_row_s=0.0, per_prefill_token_s=service)
    limits = SchedulerLimits(max_num_seqs=1, max_num_batched_tokens=1, chunk=1)
    rate = rho / service
    mu = 1.0 / service
    expected = rho / (2 * mu * (1 - rho))  # Pollaczek-Khinchine, deterministic service
    waits = []
    for seed in range(4):
        reqs = draw_requests(LengthDist(1), LengthDist(1), rate, 20_000, seed=seed)
        res = simulate(reqs, model, limits)
        assert all(t == pytest.approx(e) for t, e in zip(res.ttft, res.e2e, strict=True))  # one token: done
        waits.append(statistics.fmean(t - service for t in res.ttft))
    assert statistics.fmean(waits) == pytest.approx(expected, rel=0.08)


def test_continuous_batching_step_by_step() -> None:
    # a = 10 ms per step, 1 ms per decode row, 0.1 ms per prompt token.
    model = LinearStepModel(0.010, 0.001, 0.0001)
    reqs = [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3), SimRequest(0.025, 50, 2)]
    res = simulate(reqs, model, SchedulerLimits())
    # step 1 (0 -> 30 ms): both prompts, 200 tokens: 10 + 20 = 30 ms; their first tokens.
    assert res.ttft[:2] == pytest.approx([0.030, 0.030])
    # step 2 (30 -> 47 ms): 2 decode rows + the third prompt (arrived at 25 ms): 10 + 2 + 5 = 17 ms.
    assert res.ttft[2] == pytest.approx(0.047 - 0.025)
    # step 3 (47 -> 60 ms): 3 decode rows, 13 ms: the first two end (3 tokens), the third too (2 tokens).
    assert res.e2e == pytest.approx([0.060, 0.060, 0.060 - 0.025])
    assert res.tpot[:2] == pytest.approx([0.015, 0.015])  # (60 - 30) / 2
    assert res.tpot[2] == pytest.approx(0.013)
    assert res.steps == 3 and res.max_batch == 3
    assert res.gaps(0) == pytest.approx([0.017, 0.013]) and res.gaps(2) == pytest.approx([0.013])


def test_long_prompt_is_chunked_and_budget_shared() -> None:
    model = LinearStepModel(0.0, 0.0, 0.001)  # 1 ms per prompt token, steps otherwise free
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=300, chunk=256)
    res = simulate([SimRequest(0.0, 600, 1), SimRequest(0.0, 100, 1), SimRequest(0.0, 10, 1)], model, limits)
    # step 1: the 600-token prompt runs a 256-token chunk; the 100-token one gets the 44 left, cut back to
    #   a block boundary (32); the 10-token one the last 12: 298 tokens, and the third is done
    # step 2: 256 more of the first, 44 -> 32 of the second: 288 tokens
    # step 3: the last 88 and 36: 124 tokens, both done
    assert res.steps == 3
    assert res.ttft == pytest.approx([0.710, 0.710, 0.298])


@pytest.mark.parametrize(("max_long", "expected"), [(1, [0.606, 0.650, 0.306]), (2, [0.650, 0.650, 0.650])])
def test_short_prompts_pass_a_waiting_long_one(max_long: int, expected: list[float]) -> None:
    model = LinearStepModel(0.0, 0.0, 0.001)
    limits = SchedulerLimits(max_num_batched_tokens=512, chunk=256, max_long_partial_prefills=max_long)
    res = simulate([SimRequest(0.0, 300, 1), SimRequest(0.0, 300, 1), SimRequest(0.0, 50, 1)], model, limits)
    # One long prefill at a time: step 1 runs 256 of the first and the whole short one (306 tokens); step 2
    # the first's last 44 and 256 of the second (300); step 3 the second's last 44. Two at a time: 256 + 256
    # fill step 1, then 44 + 44 + 50 end all three in step 2.
    assert res.ttft == pytest.approx(expected)


def test_front_end_latency_delays_the_engine_and_counts_in_ttft() -> None:
    model = LinearStepModel(0.010, 0.001, 0.0001)
    reqs = [SimRequest(0.0, 100, 2), SimRequest(0.015, 100, 2)]
    res = simulate(reqs, model, SchedulerLimits(), latency=ServerLatency(front_end_s=0.020))
    # the first reaches the engine at 20 ms: prompt step 20 ms, done at 40 ms; the second reaches it at
    # 35 ms, mid-step, and runs in the next step beside the first's decode (10 + 1 + 10 = 21 ms) -> 61 ms
    assert res.ttft == pytest.approx([0.040, 0.061 - 0.015])
    assert res.e2e[0] == pytest.approx(0.061)


def test_a_step_after_idle_pays_the_wake_up_and_back_to_back_steps_do_not() -> None:
    model = LinearStepModel(0.010, 0.001, 0.0001)
    latency = ServerLatency(wake_s=0.005, idle_s=0.2)
    # the first arrives after 0.5 s of idle; the second 0.1 s after the first ended (too short an idle);
    # the third 1 s later; the fourth during the third's prompt step
    reqs = [SimRequest(0.5, 100, 1), SimRequest(0.62, 100, 1), SimRequest(1.62, 100, 1), SimRequest(1.625, 100, 1)]
    res = simulate(reqs, model, SchedulerLimits(), latency=latency)
    assert res.woken == [0, 2]
    # a prompt step is 10 + 10 ms, plus 5 ms when it wakes the engine; the fourth waits out the third's step
    assert res.ttft == pytest.approx([0.025, 0.020, 0.025, 0.025 - 0.005 + 0.020])
    assert simulate(reqs, model, SchedulerLimits()).ttft == pytest.approx([0.020, 0.020, 0.020, 0.035])


def test_server_latencies_are_checked() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        ServerLatency(wake_s=-0.001)
    with pytest.raises(ValueError, match="idle_s > 0"):
        ServerLatency(idle_s=0.0)


def test_max_num_seqs_queues_the_rest() -> None:
    model = LinearStepModel(0.010, 0.0, 0.0)
    reqs = [SimRequest(0.0, 10, 5) for _ in range(6)]
    res = simulate(reqs, model, SchedulerLimits(max_num_seqs=2))
    assert res.max_batch == 2
    # pairs run one after another: 5 steps each, the pair after starts in the step after the last ends
    assert sorted(round(e, 6) for e in res.e2e) == [0.05, 0.05, 0.1, 0.1, 0.15, 0.15]


def test_closed_loop_keeps_c_in_flight() -> None:
    model = LinearStepModel(0.010, 0.001, 0.0)
    reqs = [SimRequest(123.0, 1, 4) for _ in range(12)]  # the arrival times are ignored
    res = simulate(reqs, model, SchedulerLimits(), closed_loop=3)
    assert res.max_batch == 3
    # waves of 3, each sent when the one before it ended: a prompt step (10 ms, no decode rows), then 3 decode
    # steps of 13 ms (3 rows)
    assert res.e2e == pytest.approx([0.049] * 12)
    assert res.arrival[3:6] == pytest.approx([0.049] * 3)
    assert res.summary()["req_per_s"] == pytest.approx(12 / (4 * 0.049))


def test_summary_percentiles_and_warmup() -> None:
    model = LinearStepModel(0.0, 0.0, 0.001)
    reqs = [SimRequest(float(i), 100 * (i + 1), 1) for i in range(10)]  # no overlap: TTFT = prompt ms
    s = simulate(reqs, model, SchedulerLimits(max_num_batched_tokens=2000, chunk=2000)).summary(warmup_fraction=0.5)
    assert s["num_requests"] == 5
    assert s["ttft_p50_ms"] == pytest.approx(800.0)  # 600..1000 ms
    assert s["ttft_p99_ms"] == pytest.approx(996.0)
    assert s["tpot_p50_ms"] is None
