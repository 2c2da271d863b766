"""Helpers shared by the bench tests (imported explicitly, unlike conftest fixtures)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from llmserve.bench.client import ClientConfig
from llmserve.bench.metrics import parse_slo
from llmserve.bench.runner import BenchmarkResult, RunConfig, run_benchmark
from llmserve.bench.tokens import TokenCounter, approximate_counter
from llmserve.bench.workload import WorkloadConfig, make_workload

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_bench(base_url: str, *, concurrency: tuple[int, ...] = (2,), num: tuple[int, ...] = (4,),
              counter: TokenCounter | None = None, warmup: int = 0, slo: str | None = None,
              rates: list[float] | None = None, duration: float | None = None,
              workload: str = "random", **client_kw: object) -> BenchmarkResult:
    """One in-process benchmark run with the real client and runner."""
    counter = counter or approximate_counter()
    wl = make_workload(WorkloadConfig(name=workload, input_len=32, output_len=16), counter)
    ccfg = ClientConfig(base_url=base_url, model="fake-model", **client_kw)  # type: ignore[arg-type]
    rcfg = RunConfig(concurrency=list(concurrency), request_rates=rates,
                     num_requests=list(num) if num else None, duration_s=duration, warmup=warmup,
                     progress=False, slo=parse_slo(slo))
    return asyncio.run(run_benchmark(ccfg, counter, wl, rcfg))
