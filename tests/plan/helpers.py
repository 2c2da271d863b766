"""A synthetic `llmserve bench` result: closed-loop levels of a server whose step time is a known model."""

from __future__ import annotations

from typing import Any

from llmserve.bench.metrics import percentile
from llmserve.plan.simulator import SchedulerLimits, ServerLatency, simulate
from llmserve.plan.step_model import LinearStepModel
from llmserve.plan.traffic import LengthDist, SimRequest, draw_requests


def synthetic_bench(model: LinearStepModel, prompt: int, output: int, concurrencies: tuple[int, ...],
                    limits: SchedulerLimits | None = None, records: bool = False) -> dict[str, Any]:
    """What `llmserve bench --concurrency ... --out` writes (the fields the planner reads), for a server that
    is the simulator running `model`; with `records`, per-request entries as well."""
    levels = []
    for c in concurrencies:
        reqs = [SimRequest(0.0, prompt, output)] * max(8, 2 * c)
        res = simulate(reqs, model, limits or SchedulerLimits(), closed_loop=c)
        s = res.summary()
        summary = {"mode": "concurrency", "label": f"c={c}", "concurrency": c, "num_requests": len(reqs),
                   "num_ok": len(reqs), "prompt_tokens_server_mean": float(prompt),
                   "output_tokens_per_req_mean": float(output), **{k: s[k] for k in (
                       "req_per_s", "output_tok_per_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms",
                       "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms")},
                   "itl_p50_ms": percentile([g for i in range(len(reqs)) for g in res.gaps(i)], 50) * 1e3}
        level: dict[str, Any] = {"summary": summary}
        if records:
            level["requests"] = [{"ok": True, "prompt_tokens": prompt, "output_tokens": output,
                                  "ttft_ms": t * 1e3} for t in res.ttft]
        levels.append(level)
    return {"schema": "llmserve-bench/1", "server": {"model": "synthetic"}, "summary": [lv["summary"] for lv in levels],
            "levels": levels, "complete": True}


def synthetic_rate_level(model: LinearStepModel, latency: ServerLatency, prompt: int, output: int, rate: float,
                         n: int, seed: int = 0) -> dict[str, Any]:
    """What `llmserve bench --request-rate R --out` writes (per-request records), for a server that is the
    simulator running `model` with `latency`."""
    reqs = draw_requests(LengthDist(prompt), LengthDist(output), rate, n, seed)
    res = simulate(reqs, model, SchedulerLimits(), latency=latency)
    records = [{"ok": True, "start_ms": r.arrival * 1e3, "prompt_tokens": r.prompt_len, "output_tokens": r.output_len,
                "ttft_ms": t * 1e3} for r, t in zip(reqs, res.ttft, strict=True)]
    summary = {"mode": "rate", "label": f"rate={rate}", "request_rate": rate, "num_requests": n, "num_ok": n,
               **{k: v for k, v in res.summary().items() if k.endswith("_ms") or k.endswith("_per_s")}}
    return {"schema": "llmserve-bench/1", "server": {"model": "synthetic"}, "summary": [summary],
            "levels": [{"summary": summary, "requests": records}], "complete": True}
