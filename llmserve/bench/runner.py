"""Drives load: warm-up, then one level after another, closed-loop (fixed concurrency) or open-loop
(Poisson / gamma arrivals at a fixed rate).

Why both: closed loop (N users each waiting for their answer) gives the throughput/latency curve of a
server at a given parallelism; open loop (arrivals independent of answers, like vLLM's
benchmark_serving) shows queueing once the arrival rate passes capacity, which a closed loop hides.

Levels: `concurrency` c sends `num_requests` (default max(8, 2c)) or keeps c in flight for `duration_s`;
`rate` R (default max(16, 10 s worth of) requests) draws inter-arrival times from
gamma(shape=burstiness, scale=1/(R*burstiness)) (burstiness 1 = Poisson; < 1 burstier; inf rate = all
at once), optionally capped by `max_concurrency`. Requests of
level i come from the workload stream "L{i}-...", so levels never repeat a prompt. In duration mode the
last requests are allowed to finish; wall time runs from the first send to the last completion.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from llmserve.bench.client import BenchClient, ClientConfig, RequestRecord
from llmserve.bench.metrics import SLO, summarize
from llmserve.bench.tokens import TokenCounter
from llmserve.bench.workload import BenchRequest, Workload


def default_num_requests(concurrency: float) -> int:
    """Closed loop: enough requests for every worker to send at least two, and at least 8."""
    return max(8, 2 * int(concurrency))


def default_num_requests_rate(rate: float) -> int:
    """Open loop: about 10 s of arrivals, at least 16 (32 for an infinite rate)."""
    return 32 if math.isinf(rate) else max(16, math.ceil(rate * 10))


@dataclass
class RunConfig:
    """The load pattern: which levels, how many requests (or how long) each, warm-up, seed."""

    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    request_rates: list[float] | None = None  # open loop when set (math.inf allowed)
    burstiness: float = 1.0
    max_concurrency: int | None = None  # open loop cap
    num_requests: list[int] | None = None  # per level; one value applies to all
    duration_s: float | None = None  # per level, instead of num_requests
    warmup: int = 2
    seed: int = 1234
    progress: bool = True
    slo: SLO = field(default_factory=SLO)


@dataclass(frozen=True)
class Level:
    mode: str  # "concurrency" | "rate"
    value: float
    num_requests: int | None  # None in duration mode
    duration_s: float | None = None

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"c={int(self.value)}"
        return "rate=inf" if math.isinf(self.value) else f"rate={self.value:g}/s"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode, "label": self.label}
        if self.mode == "concurrency":
            d["concurrency"] = int(self.value)
        else:
            d["request_rate"] = "inf" if math.isinf(self.value) else self.value
        return d


@dataclass
class LevelResult:
    level: Level
    summary: dict[str, Any]
    records: list[RequestRecord]


@dataclass
class BenchmarkResult:
    warmup: list[RequestRecord]
    levels: list[LevelResult]
    notes: list[str]
    client: ClientConfig  # as finally used (ignore_eos may have been turned off by the probe)

    @property
    def all_failed(self) -> bool:
        total = sum(len(lv.records) for lv in self.levels)
        return total > 0 and all(not r.ok for lv in self.levels for r in lv.records)


def plan_levels(cfg: RunConfig) -> list[Level]:
    """Expand the run config into levels, pairing each with its request count."""
    values = list(cfg.request_rates) if cfg.request_rates else [float(c) for c in cfg.concurrency]
    mode = "rate" if cfg.request_rates else "concurrency"
    if not values:
        raise ValueError("no levels: give --concurrency or --request-rate")
    counts = cfg.num_requests or []
    if counts and len(counts) not in (1, len(values)):
        raise ValueError(f"--num-requests has {len(counts)} values for {len(values)} levels")
    levels = []
    for i, v in enumerate(values):
        if mode == "concurrency" and (v < 1 or v != int(v)):
            raise ValueError(f"concurrency must be a positive integer, got {v:g}")
        if mode == "rate" and v <= 0:
            raise ValueError(f"request rate must be > 0, got {v:g}")
        if cfg.duration_s is not None:
            n = None
        elif counts:
            n = counts[0] if len(counts) == 1 else counts[i]
        else:
            n = default_num_requests(v) if mode == "concurrency" else default_num_requests_rate(v)
        levels.append(Level(mode, v, n, cfg.duration_s))
    return levels


class _Progress:
    """tqdm bar on stderr: requests done, errors, output tok/s so far."""

    def __init__(self, level: Level, enabled: bool) -> None:
        self.bar = tqdm(total=level.num_requests, desc=level.label, file=sys.stderr, unit="req",
                        disable=not enabled, dynamic_ncols=True, leave=True)
        self.t0 = time.perf_counter()
        self.errors = 0
        self.tokens = 0

    def done(self, rec: RequestRecord) -> None:
        self.errors += not rec.ok
        self.tokens += rec.output_tokens if rec.ok else 0
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix({"err": self.errors, "tok/s": f"{self.tokens / elapsed:.1f}"}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def _closed_loop(client: BenchClient, make: Callable[[int], BenchRequest], concurrency: int,
                       n: int | None, duration: float | None,
                       on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord] = []
    next_index = 0
    t_start = time.perf_counter()
    t_last = t_start

    async def worker() -> None:
        nonlocal next_index, t_last
        while True:
            if n is not None and next_index >= n:
                return
            if duration is not None and time.perf_counter() - t_start >= duration:
                return
            i = next_index
            next_index += 1
            req = make(i)
            sent = time.perf_counter() - t_start
            rec = await client.send(req)
            rec.start_s = sent
            t_last = max(t_last, time.perf_counter())
            records.append(rec)
            on_done(rec)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index), t_last - t_start


async def _open_loop(client: BenchClient, make: Callable[[int], BenchRequest], rate: float, burstiness: float,
                     n: int | None, duration: float | None, max_concurrency: int | None, rng: random.Random,
                     on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord] = []
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t_start = time.perf_counter()
    t_last = t_start

    async def one(req: BenchRequest) -> None:
        nonlocal t_last
        if sem is not None:
            await sem.acquire()
        try:
            sent = time.perf_counter() - t_start
            rec = await client.send(req)
            rec.start_s = sent
        finally:
            if sem is not None:
                sem.release()
        t_last = max(t_last, time.perf_counter())
        records.append(rec)
        on_done(rec)

    tasks: list[asyncio.Task[None]] = []
    next_t = 0.0
    i = 0
    while (n is None or i < n) and (duration is None or next_t < duration):
        delay = t_start + next_t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(make(i))))
        i += 1
        if math.isfinite(rate):
            next_t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    await asyncio.gather(*tasks)
    return sorted(records, key=lambda r: r.index), t_last - t_start


async def run_level(client_cfg: ClientConfig, counter: TokenCounter | None, workload: Workload, level: Level,
                    stream: str, cfg: RunConfig) -> LevelResult:
    """Run one level on a fresh HTTP session and summarise it."""
    if level.num_requests is not None:  # build prompts before the clock starts
        prepared = [workload.request(stream, i) for i in range(level.num_requests)]
        make: Callable[[int], BenchRequest] = prepared.__getitem__
    else:
        def make(i: int) -> BenchRequest:
            return workload.request(stream, i)
    progress = _Progress(level, cfg.progress)
    cpu0 = time.process_time()
    try:
        if level.mode == "concurrency":
            c = int(level.value)
            async with BenchClient(client_cfg, counter, connections=c + 4) as client:
                records, wall = await _closed_loop(client, make, c, level.num_requests, level.duration_s,
                                                   progress.done)
        else:
            rng = random.Random(f"{cfg.seed}:arrivals:{stream}")
            async with BenchClient(client_cfg, counter, connections=cfg.max_concurrency or 0) as client:
                records, wall = await _open_loop(client, make, level.value, cfg.burstiness,
                                                 level.num_requests, level.duration_s, cfg.max_concurrency,
                                                 rng, progress.done)
    finally:
        progress.close()
    summary = summarize(records, wall, cfg.slo, level.to_json())
    if level.mode == "rate":
        summary["burstiness"] = cfg.burstiness
        summary["max_concurrency"] = cfg.max_concurrency
    summary["client_cpu_s"] = round(time.process_time() - cpu0, 3)
    return LevelResult(level, summary, records)


async def run_warmup(client_cfg: ClientConfig, counter: TokenCounter | None, workload: Workload, n: int,
                     notes: list[str]) -> tuple[list[RequestRecord], ClientConfig]:
    """Sequential warm-up requests (not counted). The first one also probes `ignore_eos`: if the server
    rejects the request with 400/422 but accepts it without the field, the run continues without it."""
    records: list[RequestRecord] = []
    if n <= 0:
        return records, client_cfg
    async with BenchClient(client_cfg, counter, connections=2) as client:
        for i in range(n):
            rec = await client.send(workload.request("warmup", i))
            records.append(rec)
            if i == 0 and client_cfg.ignore_eos and rec.error_kind in ("http_400", "http_422"):
                plain = replace(client_cfg, ignore_eos=False)
                async with BenchClient(plain, counter, connections=2) as probe:
                    retry = await probe.send(workload.request("warmup", i))
                if retry.ok:
                    notes.append(f"server rejected ignore_eos ({rec.error_kind}): sent without it, so output "
                                 "lengths may vary")
                    return [*records, retry, *await _rest(plain, counter, workload, i + 1, n)], plain
    return records, client_cfg


async def _rest(cfg: ClientConfig, counter: TokenCounter | None, workload: Workload, start: int,
                n: int) -> list[RequestRecord]:
    async with BenchClient(cfg, counter, connections=2) as client:
        return [await client.send(workload.request("warmup", i)) for i in range(start, n)]


async def run_benchmark(client_cfg: ClientConfig, counter: TokenCounter | None, workload: Workload,
                        cfg: RunConfig, on_level: Callable[[LevelResult], None] | None = None,
                        notes: list[str] | None = None) -> BenchmarkResult:
    """Warm-up, then every level in order. `on_level` sees each level as soon as it is done."""
    notes = notes if notes is not None else []
    levels = plan_levels(cfg)
    warm, client_cfg = await run_warmup(client_cfg, counter, workload, cfg.warmup, notes)
    results: list[LevelResult] = []
    for i, level in enumerate(levels):
        stream = f"L{i}-{level.label}"
        res = await run_level(client_cfg, counter, workload, level, stream, cfg)
        results.append(res)
        if on_level is not None:
            on_level(res)
    return BenchmarkResult(warm, results, notes, client_cfg)
