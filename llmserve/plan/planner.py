"""From a model, a machine, traffic, an SLO and prices to a plan: memory fit, one replica's capacity
within the SLO, replicas, dollars, break-even against each API. The plan is a JSON-able document, so the
table, the plot and `--out` all render the same thing.

A replica's capacity is the highest Poisson arrival rate at which the simulated p99 TTFT and p99 TPOT stay
within the SLO (a search over the rate, one seed, so the response is monotone), and at most 95 % of its
saturation throughput (a queue fed faster than it drains grows without bound, whatever a finite run
says). A load balancer that spreads Poisson traffic over n replicas gives each a Poisson stream of
rate / n, so n = ceil(misses / capacity).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from llmserve.plan.cost import (
    HOURS_PER_MONTH,
    SECONDS_PER_MONTH,
    ApiPrice,
    api_per_month,
    break_even,
    dollars_per_million_tokens,
    replicas_needed,
    self_hosted_per_month,
)
from llmserve.plan.fit import StepFit
from llmserve.plan.hardware import HardwareSpec
from llmserve.plan.model_spec import GB, ModelSpec, memory_fit
from llmserve.plan.simulator import SchedulerLimits, ServerLatency, SimResult, simulate
from llmserve.plan.step_model import StepModel
from llmserve.plan.traffic import SECONDS_PER_DAY, LengthDist, SimRequest, Traffic, draw_requests


@dataclass(frozen=True)
class SLO:
    ttft_p99_s: float = 2.0
    tpot_p99_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_p99_s <= 0 or self.tpot_p99_s <= 0:
            raise ValueError(f"SLO limits must be > 0, got {self}")

    def met(self, summary: dict[str, Any]) -> bool:
        tpot = summary["tpot_p99_ms"]
        return summary["ttft_p99_ms"] <= self.ttft_p99_s * 1e3 and (tpot is None or tpot <= self.tpot_p99_s * 1e3)


@dataclass(frozen=True)
class SimSettings:
    """How long and how exactly to simulate."""

    num_requests: int = 2000
    warmup_fraction: float = 0.1  # arrivals left out of the figures: the run starts empty
    seed: int = 0
    precision: float = 0.01  # relative width at which the capacity search stops
    max_utilization: float = 0.95  # a replica's rate stays below this share of its saturation throughput

    def __post_init__(self) -> None:
        if self.num_requests < 10:
            raise ValueError(f"num_requests must be >= 10, got {self.num_requests}")
        if not 0 <= self.warmup_fraction < 0.9:
            raise ValueError(f"warmup_fraction must be in [0, 0.9), got {self.warmup_fraction}")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    quantization: str
    kv_dtype: str
    hardware: HardwareSpec
    step_model: StepModel
    traffic: Traffic
    slo: SLO = field(default_factory=SLO)
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    apis: tuple[ApiPrice, ...] = ()
    sim: SimSettings = field(default_factory=SimSettings)
    usable_memory_fraction: float = 0.9
    latency: ServerLatency = ServerLatency()  # front end and wake-up (fitted, or given)
    fit: StepFit | None = None  # where the step model came from, when it was fitted


@dataclass(frozen=True)
class Replica:
    """One server as the simulator sees it: its step time, its scheduler, what it adds outside the steps."""

    step_model: StepModel
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    latency: ServerLatency = ServerLatency()

    def run(self, reqs: list[SimRequest]) -> SimResult:
        return simulate(reqs, self.step_model, self.limits, latency=self.latency)


def predict(replica: Replica, prompt: LengthDist, output: LengthDist, rate: float, sim: SimSettings) -> dict[str, Any]:
    """Simulated bench-style figures for Poisson arrivals at `rate` requests/s on one replica."""
    return replica.run(draw_requests(prompt, output, rate, sim.num_requests, sim.seed)).summary(sim.warmup_fraction)


def saturation_throughput(replica: Replica, prompt: LengthDist, output: LengthDist, sim: SimSettings) -> float:
    """Requests/s with every request waiting from the start, so the batch is always full: the rate past
    which a queue grows without bound."""
    reqs = draw_requests(prompt, output, 1e12, sim.num_requests, sim.seed)  # all arrive at ~0
    return float(replica.run(reqs).summary()["req_per_s"])


def replica_capacity(replica: Replica, prompt: LengthDist, output: LengthDist, slo: SLO, sim: SimSettings,
                     saturation: float) -> tuple[float, dict[str, Any] | None]:
    """(highest rate within the SLO and max_utilization x `saturation`, the simulated figures there);
    (0, None) when a request alone misses the SLO."""
    lone = predict(replica, prompt, output, 1e-6, _alone(sim))  # arrivals far apart: no queueing
    if not slo.met(lone):
        return 0.0, None
    # A finite run near saturation can meet a loose TTFT SLO while its queue still grows: cap the rate.
    hi = saturation * sim.max_utilization
    res = predict(replica, prompt, output, hi, sim)
    if slo.met(res):
        return hi, res
    lo, best = 0.0, None
    while best is None or hi - lo > sim.precision * hi:
        mid = (lo + hi) / 2
        res = predict(replica, prompt, output, mid, sim)
        if slo.met(res):
            lo, best = mid, res
        else:
            hi = mid
        if hi < 1e-9:  # nothing meets it (a lone request did: only queueing breaks it, so unreachable)
            return 0.0, None
    return lo, best


def _alone(sim: SimSettings) -> SimSettings:
    return replace(sim, num_requests=10, warmup_fraction=0.0)


def make_plan(p: PlanInputs) -> dict[str, Any]:
    """The plan document (see module doc)."""
    tr = p.traffic
    mem = memory_fit(p.model, p.quantization, p.kv_dtype, p.hardware.memory_gb,
                     tr.prompt.upper() + tr.output.upper(), p.usable_memory_fraction)
    seqs = min(p.limits.max_num_seqs, mem.max_concurrency)
    doc: dict[str, Any] = {
        "schema": "llmserve-plan/1",
        "inputs": {
            "model": asdict(p.model), "quantization": p.quantization, "kv_dtype": p.kv_dtype,
            "hardware": asdict(p.hardware), "step_model": p.step_model.describe(),
            "traffic": {**asdict(tr), "requests_per_day": tr.rate * SECONDS_PER_DAY, "miss_rate": tr.miss_rate},
            "slo": asdict(p.slo), "scheduler": asdict(p.limits), "simulation": asdict(p.sim),
            "front_end_s": p.latency.front_end_s, "wake_s": p.latency.wake_s,
            "wake_after_idle_s": p.latency.idle_s,
            "apis": [asdict(a) for a in p.apis],
        },
        "memory": {
            "memory_gb": mem.memory_bytes / GB, "usable_gb": mem.usable_bytes / GB,
            "weights_gb": mem.weight_bytes / GB, "kv_bytes_per_token": mem.kv_bytes_per_token,
            "tokens_per_seq": mem.tokens_per_seq, "kv_gb_per_seq": mem.kv_bytes(1) / GB,
            "max_concurrency_kv": mem.max_concurrency, "weights_fit": mem.weights_fit,
            "max_num_seqs_used": seqs,
        },
    }
    if p.fit is not None:
        doc["inputs"]["step_model"] = p.fit.describe()
    if seqs < 1:
        doc["feasible"] = False
        doc["reason"] = "the weights and one sequence's KV do not fit in the usable memory"
        return doc
    replica = Replica(p.step_model, replace(p.limits, max_num_seqs=seqs), p.latency)
    saturation = saturation_throughput(replica, tr.prompt, tr.output, p.sim)
    capacity, at_cap = replica_capacity(replica, tr.prompt, tr.output, p.slo, p.sim, saturation)
    if capacity <= 0 or at_cap is None:
        doc["feasible"] = False
        doc["reason"] = "a single request alone misses the SLO on this machine"
        doc["alone"] = predict(replica, tr.prompt, tr.output, 1e-6, _alone(p.sim))
        return doc
    replicas = replicas_needed(tr.miss_rate, capacity)
    per_replica = tr.miss_rate / replicas
    at_load = predict(replica, tr.prompt, tr.output, per_replica, p.sim) if per_replica > 0 else None
    monthly = self_hosted_per_month(tr.miss_rate, capacity, p.hardware.dollars_per_hour)
    peak = at_load["max_batch"] if at_load else 0
    doc["memory"].update(needed_concurrency=peak, kv_gb_needed=mem.kv_bytes(peak) / GB, fits=mem.fits(peak))
    doc.update(
        feasible=True,
        capacity={"requests_per_s": capacity, "requests_per_day": capacity * SECONDS_PER_DAY,
                  "saturation_requests_per_s": saturation, "at_capacity": at_cap},
        replicas=replicas,
        per_replica={"requests_per_s": per_replica, "predicted": at_load},
        cost={"dollars_per_month": monthly,
              "dollars_per_1m_tokens": dollars_per_million_tokens(monthly, tr.miss_rate, tr.tokens_per_request),
              "dollars_per_1m_tokens_at_capacity": dollars_per_million_tokens(
                  p.hardware.dollars_per_hour * HOURS_PER_MONTH, capacity, tr.tokens_per_request)},
        apis=[_api_row(a, p, capacity, monthly) for a in p.apis],
    )
    return doc


def _api_row(api: ApiPrice, p: PlanInputs, capacity: float, monthly: float) -> dict[str, Any]:
    tr = p.traffic
    be = break_even(api, capacity, p.hardware.dollars_per_hour, tr.prompt.mean, tr.output.mean)
    hit = 1.0 - tr.cache_hit_share  # break-even in total traffic, the unit the traffic was given in

    def total(rate: float | None) -> float | None:
        return None if rate is None else rate / hit

    api_monthly = api_per_month(tr.miss_rate, api, tr.prompt.mean, tr.output.mean)
    return {"api": api.name, "input_per_m": api.input_per_m, "output_per_m": api.output_per_m,
            "api_dollars_per_month": api_monthly, "self_hosted_dollars_per_month": monthly,
            "self_hosted_cheaper": monthly < api_monthly,
            "break_even_requests_per_s": total(be.first),
            "break_even_requests_per_day": None if be.first is None else total(be.first) * SECONDS_PER_DAY,
            "always_cheaper_above_requests_per_s": total(be.always_above),
            "dollars_per_month_per_request_per_s": SECONDS_PER_MONTH * api.dollars_per_request(
                tr.prompt.mean, tr.output.mean) * hit}
