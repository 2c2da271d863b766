"""A `LinearStepModel` fitted to the closed-loop levels of `llmserve bench` results.

Why by simulation rather than a formula per level: in a closed loop the steps' contents do not depend on
their durations (a client sends its next request when its answer ends, which is a step boundary), so the
schedule of a level can be replayed in the simulator once, and every measured mean is then a linear
function of the step model's coefficients: mean TPOT at concurrency c = sum over coefficients of
(coefficient x the mean TPOT the same schedule has when a step costs just that feature). A steady-state
formula would miss what a bench run really does: its c clients start together, so prompts arrive in
waves, and a wave's prompt chunks share steps with the decodes of the wave before.

Two parts, because a request's time to first token has two: the engine's steps, and the server's front end
(HTTP, chat template, tokenizer) before the engine sees it.
- The engine's coefficients, from what decoding streams see, which is engine time only: per closed-loop
  level, the mean TPOT (decode steps against the batch size, with the prompt chunks of the streams that
  start meanwhile) and the median inter-token gap (a step without prompt tokens, where those are most
  steps). Least squares in relative error, coefficients >= 0.
- The front end's latency and the prompt's cost, from the mean TTFT at concurrency 1: the front end (a
  constant per request) plus the engine's prefill steps. With concurrency-1 levels at two or more prompt
  lengths (a factor of 1.5 apart) they join the least squares as observations, with the front end as a
  fifth unknown: the prompt lengths tell the constant from the per-token cost. This matters because the
  decode streams above see prompt chunks only as a few long gaps, so they pin the per-token cost loosely:
  from one prompt length the fit can take part of the prompt's cost for front end, which a queue of prompts does
  not wait on (docs/performance.md, "Capacity planning"). With one prompt length the front end is what the
  measured TTFT has beyond the fitted engine's.
  TTFT at higher concurrency is not used: a closed loop's c clients send at once, and the front end, on
  the cores the model uses, then holds whole waves of first tokens back together (a measured c=32 wave:
  32 equal TTFTs), which Poisson arrivals do not do.
- The engine's wake-up (ServerLatency.wake_s): a step after the engine idled is slower on a host whose
  cores idled, which no closed-loop level shows. From request-rate levels in the files (light Poisson load,
  `llmserve bench --request-rate`), replayed with their own arrival times and token counts: the median of
  measured minus simulated TTFT over the requests that found the simulated engine idle. Without such a
  level it is 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from llmserve.plan.simulator import SchedulerLimits, ServerLatency, SimResult, simulate
from llmserve.plan.step_model import LinearStepModel
from llmserve.plan.traffic import SimRequest

COEFFICIENTS = ("overhead_s", "per_decode_row_s", "per_prefill_token_s", "per_attention_pair_s")
MIN_WAKE_SAMPLES = 5  # requests that found the engine idle, for a wake-up cost to be fitted
PROMPT_LENGTH_RATIO = 1.5  # concurrency-1 prompt lengths this far apart tell the front end from prefill
# The attention term, where the data can tell it apart at all, joins only if it halves the fit's RMS relative
# error: one coefficient for a decode row's KV reads and a prompt's (query, key) products, costs that differ by
# orders of magnitude, is a degree of freedom that noise fills: let in on a smaller gain, it bent the prompt's cost
# into a curve and the predicted TPOT under Poisson load came out low (docs/performance.md, "Capacity planning").
ATTENTION_GAIN = 0.5


@dataclass(frozen=True)
class Observation:
    source: str
    seconds: float  # the measured mean
    features: tuple[float, float, float, float]  # the same mean with a step costing 1, rows, tokens, pairs
    front_end: float = 0.0  # how many times the front end's latency the mean holds (1 for a TTFT)
    prompt_len: float = 0.0  # the level's mean prompt tokens
    num_requests: int = 0  # the level's requests (weighs a TTFT in the mean TTFT at concurrency 1)


@dataclass(frozen=True)
class StepFit:
    model: LinearStepModel
    observations: list[Observation]
    predicted: list[float]
    columns: list[str]  # the coefficients the data could tell apart (the others are 0), "front_end_s" if fitted
    # front end: 0 without a concurrency-1 level; wake-up: 0 without a request-rate level
    latency: ServerLatency = ServerLatency()
    ttft_c1: tuple[float, float] | None = None  # (measured, engine's) mean TTFT at concurrency 1
    wake_samples: int = 0  # requests of request-rate levels that found the engine idle

    def describe(self) -> dict[str, Any]:
        rows = [{"source": o.source, "measured_ms": o.seconds * 1e3, "fitted_ms": p * 1e3,
                 "error": p / o.seconds - 1} for o, p in zip(self.observations, self.predicted, strict=True)]
        ttft = None if self.ttft_c1 is None else {"measured_ms": self.ttft_c1[0] * 1e3,
                                                  "engine_ms": self.ttft_c1[1] * 1e3}
        return {**self.model.describe(), "fitted_columns": self.columns, "observations": rows,
                "front_end_s": self.latency.front_end_s, "wake_s": self.latency.wake_s,
                "wake_after_idle_s": self.latency.idle_s, "wake_samples": self.wake_samples, "ttft_c1": ttft}


@dataclass(frozen=True)
class _Feature:
    """A step model whose step costs one of the features: the simulator then sums that feature."""

    index: int

    def step_time(self, decode_rows: int, decode_context: int, prefill_tokens: int, prefill_pairs: float) -> float:
        return (1.0, decode_rows, prefill_tokens, decode_context + prefill_pairs)[self.index]

    def describe(self) -> dict[str, Any]:
        return {"kind": f"feature {COEFFICIENTS[self.index]}"}


def closed_loop_levels(doc: dict[str, Any]) -> list[tuple[dict[str, Any], list[SimRequest]]]:
    """(summary, the requests it ran) of each closed-loop level: from the per-request records (server
    token counts) where the file has them, else the level's mean lengths."""
    levels = doc.get("levels") or [{"summary": s} for s in doc.get("summary", [])]
    out = []
    for level in levels:
        s = level.get("summary", {})
        if s.get("mode") != "concurrency" or not s.get("num_ok"):
            continue
        recs = [r for r in level.get("requests", []) if r.get("ok") and r.get("prompt_tokens")]
        if recs:
            reqs = [SimRequest(0.0, int(r["prompt_tokens"]), max(1, int(r.get("output_tokens") or 1))) for r in recs]
        else:
            prompt = s.get("prompt_tokens_server_mean") or s.get("prompt_tokens_expected_mean")
            output = s.get("output_tokens_per_req_mean")
            if not prompt or not output:
                continue
            reqs = [SimRequest(0.0, round(prompt), round(output))] * int(s["num_ok"])
        out.append((s, reqs))
    return out


def rate_levels(doc: dict[str, Any]) -> list[tuple[dict[str, Any], list[SimRequest], list[dict[str, Any]]]]:
    """(summary, the requests it ran, their bench records) of each request-rate level with per-request
    records: the run's own send times and server token counts, in arrival order."""
    out = []
    for level in doc.get("levels", []):
        s = level.get("summary", {})
        if s.get("mode") != "rate":
            continue
        recs = sorted((r for r in level.get("requests", []) if r.get("ok") and r.get("prompt_tokens")
                       and r.get("ttft_ms") is not None and r.get("start_ms") is not None),
                      key=lambda r: r["start_ms"])
        if not recs:
            continue
        reqs = [SimRequest(r["start_ms"] / 1e3, int(r["prompt_tokens"]), max(1, int(r.get("output_tokens") or 1)))
                for r in recs]
        out.append((s, reqs, recs))
    return out


def observations(docs: Sequence[dict[str, Any]], limits: SchedulerLimits,
                 min_plain_share: float = 0.7) -> list[Observation]:
    """The fit's observations (see the module doc): TPOT means, median gaps and concurrency-1 TTFT means; the
    median gap counts as a plain decode step where at least `min_plain_share` of a stream's steps carry no
    prompt tokens."""
    obs = []
    for doc in docs:
        for s, reqs in closed_loop_levels(doc):
            c = int(s["concurrency"])
            prompt = sum(r.prompt_len for r in reqs) / len(reqs)
            tag = f"c={c} ({prompt:.0f}-token prompts)"
            runs = [simulate(reqs, _Feature(i), limits, closed_loop=c) for i in range(4)]  # one schedule, 4 costs
            feats = [run.summary() for run in runs]
            if s.get("tpot_mean_ms") and feats[0]["tpot_mean_ms"] is not None:
                obs.append(Observation(f"TPOT {tag}", s["tpot_mean_ms"] / 1e3,
                                       tuple(f["tpot_mean_ms"] / 1e3 for f in feats)))
            typical = _typical_plain_step(runs[0], min_plain_share)
            if s.get("itl_p50_ms") and typical is not None:
                obs.append(Observation(f"ITL p50 {tag}", s["itl_p50_ms"] / 1e3, (1.0, typical[0], 0.0, typical[1])))
            if c == 1 and s.get("ttft_mean_ms"):
                obs.append(Observation(f"TTFT {tag}", s["ttft_mean_ms"] / 1e3,
                                       tuple(statistics.fmean(run.ttft) for run in runs), 1.0, prompt, len(reqs)))
    return obs


def _typical_plain_step(res: SimResult, min_plain_share: float) -> tuple[float, float] | None:
    """(decode rows, their context) of the median step the decoding streams wait on, when at least
    `min_plain_share` of those steps carry no prompt tokens (the median gap is then such a step)."""
    shapes = [res.step_shape[k] for i in range(len(res.ttft)) for k in res.decode_steps(i)]
    plain = sorted((rows, ctx) for rows, ctx, prompt in shapes if not prompt)
    if not shapes or len(plain) < min_plain_share * len(shapes):
        return None
    rows, ctx = plain[len(plain) // 2]
    return float(rows), float(ctx)


def fit_step_model(docs: Sequence[dict[str, Any]], limits: SchedulerLimits | None = None) -> StepFit:
    """Fit to the closed-loop levels of bench results measured with the scheduler `limits`. The attention
    term joins only where the data can tell it from the per-row and per-token costs (prompt lengths that
    differ across levels or files); with one prompt length it is a multiple of them. The front end joins
    where concurrency-1 levels at two prompt lengths can tell it from the prompt's cost (module doc)."""
    limits = limits or SchedulerLimits()
    obs = observations(docs, limits)
    if len({o.source.split(" c=")[1] for o in obs if o.source.startswith("TPOT")}) < 2:
        raise ValueError("a step model needs closed-loop levels at two or more concurrencies "
                         "(llmserve bench --concurrency 1,4,16,...)")
    ttft = [o for o in obs if o.front_end]
    lengths = [o.prompt_len for o in ttft]
    joint = len(lengths) > 1 and max(lengths) >= PROMPT_LENGTH_RATIO * min(lengths)
    if not joint:  # the TTFTs cannot tell the front end from prefill: the front end is their residual
        obs = [o for o in obs if not o.front_end]
    x = np.array([(*o.features, o.front_end) for o in obs])
    y = np.array([o.seconds for o in obs])
    rel = x / y[:, None]  # relative error: each row divided by its measurement
    base = [0, 1, 2] + ([4] if joint else [])
    coef, active = _nonnegative_fit(rel, base)
    if _separable(rel[:, :4], 3):  # the attention term joins where it pays (see ATTENTION_GAIN)
        with_pairs, active_pairs = _nonnegative_fit(rel, sorted([*base, 3]))
        if _rms(rel, with_pairs) < (1 - ATTENTION_GAIN) * _rms(rel, coef):
            coef, active = with_pairs, active_pairs
    model = LinearStepModel(*(float(v) for v in coef[:4]))
    ttft_c1 = _ttft_at_one(ttft, coef)
    # joint: a coefficient of the fit; else what the measured TTFT at c=1 has beyond the fitted engine's
    residual = max(0.0, ttft_c1[0] - ttft_c1[1]) if ttft_c1 else 0.0
    latency = ServerLatency(front_end_s=float(coef[4]) if joint else residual)
    wake, samples = _wake_after_idle(docs, model, limits, latency)
    return StepFit(model, obs, [float(v) for v in x @ coef], [(*COEFFICIENTS, "front_end_s")[i] for i in active],
                   replace(latency, wake_s=wake), ttft_c1, samples)


def _wake_after_idle(docs: Sequence[dict[str, Any]], model: LinearStepModel, limits: SchedulerLimits,
                     latency: ServerLatency) -> tuple[float, int]:
    """(wake-up seconds, how many requests it was measured on): the median TTFT the requests that found
    the engine idle have beyond the simulated one, over the request-rate levels replayed as they ran."""
    extra = []
    for doc in docs:
        for _s, reqs, records in rate_levels(doc):
            sim = simulate(reqs, model, limits, latency=latency)
            extra += [records[i]["ttft_ms"] / 1e3 - sim.ttft[i] for i in sim.woken]
    if len(extra) < MIN_WAKE_SAMPLES:
        return 0.0, len(extra)
    return max(0.0, statistics.median(extra)), len(extra)


def _nonnegative_fit(rel: np.ndarray, columns: list[int]) -> tuple[np.ndarray, list[int]]:
    """Least squares of `rel` @ coef = 1 over `columns`, dropping the most negative until none is negative
    (a negative cost: the data cannot see that one); the coefficients and the columns kept."""
    active, coef = list(columns), np.zeros(rel.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(rel[:, active], np.ones(len(rel)), rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef, active


def _rms(rel: np.ndarray, coef: np.ndarray) -> float:
    return float(np.sqrt(np.mean((rel @ coef - 1) ** 2)))


def _ttft_at_one(ttft: list[Observation], coef: np.ndarray) -> tuple[float, float] | None:
    """(measured, fitted engine) mean TTFT over the concurrency-1 levels' TTFT observations, weighted by
    requests: the engine's is linear in the coefficients, so their replays are not run again."""
    n = sum(o.num_requests for o in ttft)
    if not n:
        return None
    measured = sum(o.seconds * o.num_requests for o in ttft)
    engine = sum(float(np.dot(o.features, coef[:4])) * o.num_requests for o in ttft)
    return measured / n, engine / n


def _separable(rel: np.ndarray, column: int, tolerance: float = 0.02) -> bool:
    """Whether `column` is more than `tolerance` (relative) away from the span of the other columns."""
    others = np.delete(rel, column, axis=1)
    target = rel[:, column]
    sol, *_ = np.linalg.lstsq(others, target, rcond=None)
    return bool(np.linalg.norm(others @ sol - target) > tolerance * np.linalg.norm(target))
