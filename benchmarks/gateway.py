#!/usr/bin/env python3
"""The gateway, measured with real replicas (`llmserve serve`, default flags) and `llmserve bench`.

    .venv/bin/python benchmarks/gateway.py --parts prefix      # prefix_aware vs round_robin, 2 replicas
    .venv/bin/python benchmarks/gateway.py --parts overhead    # through the gateway vs straight to the replica
    .venv/bin/python benchmarks/gateway.py --parts cache --concurrency 4   # repeated queries, 40 % near-duplicates

prefix: two replicas, one core each (OMP_NUM_THREADS=1), each with a KV cache that holds about half of the
8 system prompts of a shared-prefix workload; restarted for every policy so each starts cold. Reports the
replicas' prefix-cache hit rate (tokens, from their /metrics) and the bench's TTFT.
overhead: one replica on CPU 0, the gateway (`--no-cache`) and the client on CPU 1: paired single-token requests
straight and through the gateway (TTFT added, per pair), and output tok/s at c = 64 in ABBA rounds.
cache: one replica; the gateway without a cache, then with the exact and semantic caches, on 300 questions of
which 40 % are rewordings of earlier ones (`repeated_queries`): upstream calls saved, false hits, e2e p50/p99.
Writes benchmarks/results/gateway_<part>.md and .json (and the bench result files beside them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import machine_facts, port_free, stop_group  # noqa: E402

from llmserve.bench.client import BenchClient, ClientConfig  # noqa: E402
from llmserve.bench.report import load_result, render_table  # noqa: E402
from llmserve.bench.tokens import approximate_counter  # noqa: E402
from llmserve.bench.workload import WorkloadConfig, make_workload  # noqa: E402

MODEL = "smollm2-135m"


class Proc:
    """A child process in its own group, with its log under the results folder."""

    def __init__(self, name: str, cmd: list[str], port: int, out_dir: Path, env: dict[str, str] | None = None,
                 ready: str = "/health") -> None:
        if not port_free(port):
            raise SystemExit(f"port {port} is busy")
        self.name, self.port = name, port
        self.log = (out_dir / f"gateway_{name}.log").open("w")
        print(f"[gateway-bench] start {name}: {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        deadline = time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{name} not ready after 900 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_group(self.proc, self.proc.pid)
        self.log.close()


def replica(name: str, port: int, args: argparse.Namespace, threads: int | None = None,
            flags: tuple[str, ...] = (), cpus: str | None = None) -> Proc:
    cmd = [*_pinned(cpus), sys.executable, "-m", "llmserve.cli", "serve", "--model", MODEL, "--port", str(port),
           "--no-access-log", *flags]
    return Proc(name, cmd, port, args.out_dir, {"OMP_NUM_THREADS": str(threads)} if threads else None)


def gateway(name: str, port: int, upstreams: list[str], args: argparse.Namespace, *flags: str,
            cpus: str | None = None) -> Proc:
    cmd = [*_pinned(cpus), sys.executable, "-m", "llmserve.cli", "gateway", "--upstream",
           f"{MODEL}={','.join(upstreams)}", "--port", str(port), "--no-access-log", *flags]
    return Proc(name, cmd, port, args.out_dir)


def _pinned(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def bench(label: str, url: str, args: argparse.Namespace, *flags: str) -> dict[str, Any]:
    out = args.out_dir / f"gateway_{label}.json"
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", url, "--model", MODEL, "--temperature", "0",
           "--seed", "1234", "--label", label, "--out", str(out), "--no-progress", *flags]
    print(f"[gateway-bench] {label}: {' '.join(cmd[3:])}", flush=True)
    subprocess.check_call(cmd, cwd=REPO)
    return load_result(out)


def scrape(url: str, prefix: str = "llmserve:") -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def part_prefix(args: argparse.Namespace) -> str:
    flags = ("--workload", "shared-prefix", "--num-prefixes", "8", "--prefix-len", str(args.prefix_len),
             "--input-len", str(args.prefix_len + 60), "--output-len", "16", "--concurrency", str(args.concurrency),
             "--num-requests", str(args.num_requests), "--warmup", "0")
    kv = ("--kv-cache-memory-gb", str(args.kv_gb))
    rows, record = [], {}
    policies = ["round_robin", "prefix_aware"]
    for round_ in range(args.rounds):
        for policy in policies if round_ % 2 == 0 else policies[::-1]:
            reps = [replica(f"prefix_replica{i}", args.port + 1 + i, args, threads=1, flags=kv) for i in range(2)]
            gw = None
            try:
                gw = gateway("prefix_gw", args.port, [r.url for r in reps], args, "--balancing", policy, "--no-cache")
                before = [scrape(r.url) for r in reps]
                doc = bench(f"prefix_{policy}_r{round_ + 1}", gw.url, args, *flags)
                after = [scrape(r.url) for r in reps]
            finally:
                for p in ([gw] if gw else []) + reps:
                    p.stop()
            hits = sum(a["llmserve:prefix_cache_hits_total"] - b["llmserve:prefix_cache_hits_total"]
                       for a, b in zip(after, before, strict=True))
            queries = sum(a["llmserve:prefix_cache_queries_total"] - b["llmserve:prefix_cache_queries_total"]
                          for a, b in zip(after, before, strict=True))
            s = doc["summary"][0]
            record.setdefault(policy, []).append({"hit_rate": hits / max(queries, 1), "ttft_p50_ms": s["ttft_p50_ms"],
                                                  "ttft_p99_ms": s["ttft_p99_ms"], "out_tok_s": s["output_tok_per_s"],
                                                  "ok": s["num_ok"]})
    for policy in policies:
        runs = record[policy]
        rows.append([policy, f"{statistics.median(r['hit_rate'] for r in runs):.1%}",
                     f"{statistics.median(r['ttft_p50_ms'] for r in runs):.0f}",
                     f"{statistics.median(r['ttft_p99_ms'] for r in runs):.0f}",
                     f"{statistics.median(r['out_tok_s'] for r in runs):.1f}"])
    rr, pa = record["round_robin"], record["prefix_aware"]
    ratio_hit = statistics.median(p["hit_rate"] / max(r["hit_rate"], 1e-9) for p, r in zip(pa, rr, strict=True))
    ttft_cut = statistics.median(1 - p["ttft_p50_ms"] / r["ttft_p50_ms"] for p, r in zip(pa, rr, strict=True))
    (args.out_dir / "gateway_prefix.json").write_text(json.dumps(record, indent=1))
    return (f"## prefix_aware vs round_robin (2 replicas, 1 core each, KV cache {args.kv_gb} GB each)\n\n"
            f"shared-prefix workload: 8 system prompts of >= {args.prefix_len} tokens, c = {args.concurrency}, "
            f"{args.num_requests} requests, 16 output tokens; median of {args.rounds} round(s) (ABBA).\n\n"
            + render_table(["policy", "prefix-cache hit rate", "TTFT p50 ms", "TTFT p99 ms", "output tok/s"], rows,
                           markdown=True)
            + f"\n\nprefix_aware / round_robin: hit rate {ratio_hit:.2f}x, TTFT p50 {ttft_cut:.0%} lower "
              "(per-round ratios, median).")


def part_overhead(args: argparse.Namespace) -> str:
    """What the gateway adds, with the cores split so that neither side steals the other's: the replica on
    CPU 0 (one thread), the gateway and the load generator on CPU 1. TTFT: `--pairs` pairs of single-token
    requests, each pair one straight to the replica and one through the gateway in random order, on kept-alive
    connections, each request its own prompt (no prefix-cache hit between the two); the added time is the
    median of the per-pair differences, which cancels the replica's drift. Throughput: c = 64 in ABBA rounds."""
    pin = (os.cpu_count() or 1) >= 2
    rep = replica("overhead_replica", args.port + 1, args, threads=1, cpus="0" if pin else None)
    gw = gateway("overhead_gw", args.port, [rep.url], args, "--no-cache", cpus="1" if pin else None)
    if pin:
        os.sched_setaffinity(0, {1})  # this process and the `llmserve bench` children it starts
    tput: dict[str, list[float]] = {"direct": [], "gateway": []}
    try:
        # a fresh server's first requests are slower (caches, allocator, lazily built paths): not measured
        for url in (rep.url, gw.url):
            bench("overhead_warmup", url, args, "--workload", "random", "--input-len", "32", "--output-len", "64",
                  "--concurrency", "1,64", "--num-requests", "8,64", "--warmup", "2")
        ttft = asyncio.run(paired_ttft(rep.url, gw.url, args.pairs))
        for round_ in range(args.rounds):
            order = [("direct", rep.url), ("gateway", gw.url)]
            for name, url in order if round_ % 2 == 0 else order[::-1]:
                # long answers: the gateway's work is per streamed token, so decode is where it shows
                c64 = bench(f"overhead_{name}_c64_r{round_ + 1}", url, args, "--workload", "random", "--input-len",
                            "32", "--output-len", "128", "--concurrency", "64", "--num-requests", "128",
                            "--warmup", "0")
                tput[name].append(c64["summary"][0]["output_tok_per_s"])
    finally:
        gw.stop()
        rep.stop()
    added = [g - d for d, g in zip(ttft["direct"], ttft["gateway"], strict=True)]
    q1, q2, q3 = statistics.quantiles(added, n=4)
    share = statistics.median(g / d for d, g in zip(tput["direct"], tput["gateway"], strict=True))
    rows = [[name, f"{statistics.median(ttft[name]):.2f}", f"{statistics.quantiles(ttft[name], n=100)[98]:.2f}",
             f"{statistics.median(tput[name]):.1f}"] for name in ("direct", "gateway")]
    (args.out_dir / "gateway_overhead.json").write_text(json.dumps({"ttft_ms": ttft, "out_tok_s_c64": tput,
                                                                    "pinned": pin}, indent=1))
    cores = "replica on CPU 0 (1 thread), gateway and client on CPU 1" if pin else "unpinned (one CPU)"
    return ("## Overhead: through the gateway vs straight to the replica (one replica, cache off)\n\n"
            f"{cores}. TTFT: {args.pairs} pairs of single-token requests (32 prompt tokens), direct and through "
            f"the gateway in random order within each pair, kept-alive connections. c = 64: 128 requests of 128 "
            f"output tokens, median of {args.rounds} round(s) (ABBA).\n\n"
            + render_table(["path", "TTFT p50 ms", "TTFT p99 ms", "output tok/s (c=64)"], rows, markdown=True)
            + f"\n\nTTFT added by the gateway, per pair: median {q2:+.2f} ms (quartiles {q1:+.2f} / {q3:+.2f}); "
              f"throughput at c = 64: {share:.1%} of direct (per-round ratios, median).")


async def paired_ttft(direct: str, via_gateway: str, pairs: int, seed: int = 1234) -> dict[str, list[float]]:
    """TTFT in ms of `pairs` requests down each path, interleaved pair by pair in a seeded random order."""
    workload = make_workload(WorkloadConfig(name="random", input_len=32, output_len=1, seed=seed),
                             approximate_counter())
    rng = random.Random(seed)
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    configs = {name: ClientConfig(base_url=url, model=MODEL, keepalive=True)
               for name, url in (("direct", direct), ("gateway", via_gateway))}
    async with BenchClient(configs["direct"]) as d, BenchClient(configs["gateway"]) as g:
        clients = {"direct": d, "gateway": g}
        for i in range(pairs):
            names = ["direct", "gateway"]
            rng.shuffle(names)
            for j, name in enumerate(names):
                rec = await clients[name].send(workload.request("paired", 2 * i + j))
                if not rec.ok or rec.ttft_s is None:
                    raise RuntimeError(f"{name} request failed: {rec.error_kind} {rec.error}")
                out[name].append(rec.ttft_s * 1000)
            if (i + 1) % 50 == 0:
                print(f"[gateway-bench] paired TTFT: {i + 1}/{pairs}", flush=True)
    return out


def repeated_queries(seed: int = 1234) -> list[tuple[str, str]]:
    """300 (question, kind) in arrival order, 40 % near-duplicates: 120 of fow-cache's same-answer pairs (a
    first, its rewording b later: "near-dup") and, as distinct questions, 30 of its different-answer pairs
    (both sides; a cache hit on the later side, "hard-negative", is a false hit)."""
    import random

    from llmserve.evaluate.datasets import CACHE_PAIRS, package_file

    rng = random.Random(seed)
    rows = [json.loads(line) for line in package_file(CACHE_PAIRS).read_text().splitlines() if line.strip()]
    same = rng.sample([r for r in rows if r["same_answer"]], 120)
    different = rng.sample([r for r in rows if not r["same_answer"]], 30)
    firsts = [(r["a"], "fresh") for r in same] + [(r["a"], "fresh") for r in different]
    rng.shuffle(firsts)
    order = list(firsts)
    for r in same:  # the rewording goes somewhere after its original
        at = order.index((r["a"], "fresh"))
        order.insert(rng.randint(at + 1, len(order)), (r["b"], "near-dup"))
    for r in different:
        at = order.index((r["a"], "fresh"))
        order.insert(rng.randint(at + 1, len(order)), (r["b"], "hard-negative"))
    return order


async def drive(url: str, queries: list[tuple[str, str]], concurrency: int, max_tokens: int) -> list[dict]:
    """Closed loop: `concurrency` workers take the queries in order; per request its latency and cache header."""
    import asyncio

    import httpx

    results: list[dict] = [{} for _ in queries]
    next_index = iter(range(len(queries)))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in next_index:
            question, kind = queries[i]
            started = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                "temperature": 0})
            results[i] = {"kind": kind, "status": r.status_code, "cache": r.headers.get("x-llmserve-cache"),
                          "e2e_ms": (time.perf_counter() - started) * 1000}

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


def part_cache(args: argparse.Namespace) -> str:
    import asyncio

    queries = repeated_queries()
    rep = replica("cache_replica", args.port + 1, args)
    record: dict[str, dict] = {}
    try:
        for name, flags in (("no cache", ("--no-cache",)),
                            ("exact + semantic (default threshold)", ("--semantic-cache",)),
                            ("exact + semantic, threshold 0.92", ("--semantic-cache", "--semantic-threshold", "0.92"))):
            gw = gateway("cache_gw", args.port, [rep.url], args, *flags)
            try:
                started = time.perf_counter()
                results = asyncio.run(drive(gw.url, queries, args.concurrency, 32))
                wall = time.perf_counter() - started
                metrics = scrape(gw.url, "llmserve:gateway_")
            finally:
                gw.stop()
            lat = sorted(r["e2e_ms"] for r in results)
            hits = [r for r in results if r["cache"] in ("hit", "semantic")]
            record[name] = {
                "requests": len(results), "ok": sum(r["status"] == 200 for r in results), "wall_s": wall,
                "upstream_calls_saved": len(hits) / len(results),
                "near_dup_hit_rate": sum(r["cache"] in ("hit", "semantic") for r in results
                                         if r["kind"] == "near-dup") / sum(r["kind"] == "near-dup" for r in results),
                "false_hits": sum(r["kind"] == "hard-negative" and r["cache"] in ("hit", "semantic")
                                  for r in results),
                "guard_rejections": metrics.get("llmserve:gateway_cache_guard_rejections_total", 0.0),
                "e2e_p50_ms": lat[len(lat) // 2], "e2e_p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}
    finally:
        rep.stop()
    (args.out_dir / "gateway_cache.json").write_text(json.dumps(record, indent=1))
    rows = [[name, f"{r['ok']}/{r['requests']}", f"{r['upstream_calls_saved']:.1%}", f"{r['near_dup_hit_rate']:.1%}",
             str(r["false_hits"]), f"{r['guard_rejections']:.0f}", f"{r['e2e_p50_ms']:.0f}", f"{r['e2e_p99_ms']:.0f}",
             f"{r['wall_s']:.0f}"] for name, r in record.items()]
    return ("## Repeated queries: 300 questions, 40 % near-duplicates (one replica, c = "
            f"{args.concurrency}, 32 output tokens, temperature 0)\n\n"
            "120 fow-cache same-answer pairs (the original, later its rewording: 'near-dup'), 30 different-answer "
            "pairs asked on both sides (a hit on the later side is a false hit).\n\n"
            + render_table(["gateway", "ok", "upstream calls saved", "near-dups served from cache", "false hits",
                            "guard rejections", "e2e p50 ms", "e2e p99 ms", "wall s"], rows, markdown=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="prefix,overhead")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8060)
    ap.add_argument("--prefix-len", type=int, default=400)
    ap.add_argument("--kv-gb", type=float, default=0.12, help="prefix part: each replica's KV cache")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=200, help="overhead part: paired TTFT probes")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    m = machine_facts()
    for part in args.parts.split(","):
        body = {"prefix": part_prefix, "overhead": part_overhead, "cache": part_cache}[part](args)
        report = (f"# Gateway: {part}\n\nGenerated {time.strftime('%Y-%m-%d %H:%M')} by `benchmarks/gateway.py "
                  f"--parts {part} --rounds {args.rounds}`; {m['cpu']}, {m['cpus']} CPUs.\n\n{body}\n")
        (args.out_dir / f"gateway_{part}.md").write_text(report)
        print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
