#!/usr/bin/env python3
"""The gateway, measured: what each of its policies buys and what it costs, with real replicas where it matters.

    .venv/bin/python benchmarks/gateway.py --parts prefix      # prefix_aware vs round_robin, 2 replicas
    .venv/bin/python benchmarks/gateway.py --parts overhead    # through the gateway vs straight to the replica
    .venv/bin/python benchmarks/gateway.py --parts cache       # repeated queries, 40 % near-duplicates
    .venv/bin/python benchmarks/gateway.py --parts threshold   # the semantic cache's threshold (no server)
    .venv/bin/python benchmarks/gateway.py --parts routing     # model routing on held-out HumanEval (no server)
    .venv/bin/python benchmarks/gateway.py --parts overhead,threshold,routing --smoke   # a smoke run, ~30 s

Why: the gateway's defaults (prefix-aware balancing, the semantic cache's 0.97 threshold with the lexical guard,
the learned router) are each chosen on one of these measurements; docs/performance.md, "The gateway", has them.

prefix: two replicas (`llmserve serve`, default flags), one core each (OMP_NUM_THREADS=1), each with a KV cache that
holds about half of the 8 system prompts of a shared-prefix workload; restarted for every policy so each starts
cold. Reports the replicas' prefix-cache hit rate (tokens, from their /metrics) and `llmserve bench`'s TTFT.
overhead: one replica on CPU 0, the gateway (`--no-cache`) and the client on CPU 1: paired single-token requests
straight and through the gateway (TTFT added, per pair), and output tok/s at c = 64 in ABBA rounds.
cache: one replica; the gateway without a cache, then with the exact and semantic caches, on 300 questions of
which 40 % are rewordings of earlier ones (`repeated_queries`): upstream calls saved, false hits, e2e p50/p99.
threshold: false hits (a cached answer served to a question that needed another) against missed hits (a true
rewording sent upstream) per cosine threshold, with and without the lexical guard (`gateway/cache/guard.py`), on
fow-cache's 600 labelled question pairs (300 same-answer, 300 hard negatives: negation, entity swap, number/date,
scope) and the STS benchmark's 8,628 scored sentence pairs (same answer = score >= 4); MiniLM embeddings as the
gateway computes them.
routing: routers between Qwen2.5-Coder-0.5B (weak) and 1.5B (strong) on held-out HumanEval problems, from the two
models' `llmserve eval --tasks humaneval` files (and a judge's scores) in the out dir:

    llmserve eval qwen2.5-coder-0.5b --tasks humaneval --out benchmarks/results/gateway/humaneval_qwen0.5b.json
    llmserve eval qwen2.5-coder-1.5b --tasks humaneval --out benchmarks/results/gateway/humaneval_qwen1.5b.json
    llmserve serve qwen2.5-coder-0.5b --port 8000 &        # the judge
    python -m llmserve.gateway.routing.train judge --weak benchmarks/results/gateway/humaneval_qwen0.5b.json \\
        --base-url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b --out benchmarks/results/gateway/judge.json

  "learned" predicts that the weak model fails, "learned-wins" that the strong model wins, "length" sends the
  longest requests to the strong model (a baseline that needs no model). Every problem is scored by a router that
  never saw it (k folds; thresholds calibrated on the training folds' scores only). Quality at a share s of strong
  calls is pass@1 when each problem gets the answer of the model its router chose. RouteLLM's measures: PGR(s) =
  (q(s) - q_weak) / (q_strong - q_weak), APGR its mean over s in 0, 0.1, ..., 1; random routing's APGR is 0.5 in
  expectation. Confidence intervals: the problems resampled (bootstrap), routers' decisions kept.

Writes <out-dir>/<part>.md and .json (threshold and routing also .png), and the bench result files beside them.
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

import numpy as np
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
        self.log = (out_dir / f"{name}.log").open("w")
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
    out = args.out_dir / f"{label}.json"
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
    (args.out_dir / "prefix.json").write_text(json.dumps(record, indent=1))
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
        c, n = args.throughput_concurrency, args.throughput_requests
        for url in (rep.url, gw.url):
            bench("overhead_warmup", url, args, "--workload", "random", "--input-len", "32", "--output-len",
                  str(args.output_len // 2), "--concurrency", f"1,{c}", "--num-requests", f"{min(8, n)},{c}",
                  "--warmup", "2")
        ttft = asyncio.run(paired_ttft(rep.url, gw.url, args.pairs))
        for round_ in range(args.rounds):
            order = [("direct", rep.url), ("gateway", gw.url)]
            for name, url in order if round_ % 2 == 0 else order[::-1]:
                # long answers: the gateway's work is per streamed token, so decode is where it shows
                c64 = bench(f"overhead_{name}_c{c}_r{round_ + 1}", url, args, "--workload", "random",
                            "--input-len", "32", "--output-len", str(args.output_len), "--concurrency", str(c),
                            "--num-requests", str(n), "--warmup", "0")
                tput[name].append(c64["summary"][0]["output_tok_per_s"])
    finally:
        gw.stop()
        rep.stop()
    added = [g - d for d, g in zip(ttft["direct"], ttft["gateway"], strict=True)]
    q1, q2, q3 = statistics.quantiles(added, n=4)
    share = statistics.median(g / d for d, g in zip(tput["direct"], tput["gateway"], strict=True))
    rows = [[name, f"{statistics.median(ttft[name]):.2f}", f"{statistics.quantiles(ttft[name], n=100)[98]:.2f}",
             f"{statistics.median(tput[name]):.1f}"] for name in ("direct", "gateway")]
    c = args.throughput_concurrency
    (args.out_dir / "overhead.json").write_text(json.dumps({"ttft_ms": ttft, "out_tok_s_c64": tput,
                                                                    "pinned": pin}, indent=1))
    cores = "replica on CPU 0 (1 thread), gateway and client on CPU 1" if pin else "unpinned (one CPU)"
    return ("## Overhead: through the gateway vs straight to the replica (one replica, cache off)\n\n"
            f"{cores}. TTFT: {args.pairs} pairs of single-token requests (32 prompt tokens), direct and through "
            f"the gateway in random order within each pair, kept-alive connections. c = {c}: "
            f"{args.throughput_requests} requests of {args.output_len} output tokens, median of {args.rounds} "
            "round(s) (ABBA).\n\n"
            + render_table(["path", "TTFT p50 ms", "TTFT p99 ms", f"output tok/s (c={c})"], rows, markdown=True)
            + f"\n\nTTFT added by the gateway, per pair: median {q2:+.2f} ms (quartiles {q1:+.2f} / {q3:+.2f}); "
              f"throughput at c = {c}: {share:.1%} of direct (per-round ratios, median).")


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
    (args.out_dir / "cache.json").write_text(json.dumps(record, indent=1))
    rows = [[name, f"{r['ok']}/{r['requests']}", f"{r['upstream_calls_saved']:.1%}", f"{r['near_dup_hit_rate']:.1%}",
             str(r["false_hits"]), f"{r['guard_rejections']:.0f}", f"{r['e2e_p50_ms']:.0f}", f"{r['e2e_p99_ms']:.0f}",
             f"{r['wall_s']:.0f}"] for name, r in record.items()]
    return ("## Repeated queries: 300 questions, 40 % near-duplicates (one replica, c = "
            f"{args.concurrency}, 32 output tokens, temperature 0)\n\n"
            "120 fow-cache same-answer pairs (the original, later its rewording: 'near-dup'), 30 different-answer "
            "pairs asked on both sides (a hit on the later side is a false hit).\n\n"
            + render_table(["gateway", "ok", "upstream calls saved", "near-dups served from cache", "false hits",
                            "guard rejections", "e2e p50 ms", "e2e p99 ms", "wall s"], rows, markdown=True))


# --- threshold: the semantic cache's cosine threshold ------------------------------------------------------------

THRESHOLDS = [round(0.80 + 0.01 * i, 2) for i in range(20)]


def fow_pairs() -> list[tuple[str, str, bool, str]]:
    from llmserve.evaluate.datasets import CACHE_PAIRS, package_file

    rows = [json.loads(line) for line in package_file(CACHE_PAIRS).read_text().splitlines() if line.strip()]
    return [(r["a"], r["b"], bool(r["same_answer"]), r["category"]) for r in rows]


def sts_pairs() -> list[tuple[str, str, bool, str]]:
    from llmserve.evaluate.datasets import STS_B, package_file

    out = []
    for split in ("sts-train.csv", "sts-dev.csv", "sts-test.csv"):
        for line in (package_file(STS_B) / split).read_text(encoding="utf-8").splitlines():
            fields = line.split("\t")
            if len(fields) >= 7:
                out.append((fields[5], fields[6], float(fields[4]) >= 4.0, fields[0]))
    return out


def cosines(embedder, pairs: list[tuple[str, str, bool, str]]) -> np.ndarray:
    a = np.concatenate([embedder.embed([p[0] for p in pairs[i:i + 128]]) for i in range(0, len(pairs), 128)])
    b = np.concatenate([embedder.embed([p[1] for p in pairs[i:i + 128]]) for i in range(0, len(pairs), 128)])
    return (a * b).sum(1)


def rates(cos: np.ndarray, same: np.ndarray, guard: np.ndarray | None, t: float) -> tuple[float, float]:
    """(false-hit rate among different-answer pairs, missed-hit rate among same-answer pairs)."""
    hit = cos >= t if guard is None else (cos >= t) & guard
    return float(hit[~same].mean()), float((~hit[same]).mean())


def part_threshold(args: argparse.Namespace) -> str:
    from llmserve.gateway.cache.guard import compatible

    embedder = embedder_once()
    record: dict = {}
    lines = ["False-hit rate: share of different-answer pairs that would be served the other's answer; missed-hit "
             "rate: share of same-answer pairs sent upstream anyway. Guarded: the lexical guard on top."]
    curves = {}
    for name, pairs in (("fow-cache", fow_pairs()), ("STS-B", sts_pairs())):
        if args.pairs_limit:  # both kinds in the sample
            rng = random.Random(0)
            pairs = rng.sample(pairs, min(args.pairs_limit, len(pairs)))
        started = time.perf_counter()
        cos = cosines(embedder, pairs)
        same = np.array([p[2] for p in pairs])
        guard = np.array([compatible(p[0], p[1]) for p in pairs])
        print(f"[gateway-bench] {name}: {len(pairs)} pairs embedded in {time.perf_counter() - started:.1f} s",
              flush=True)
        rows = []
        for t in THRESHOLDS:
            fh, mh = rates(cos, same, None, t)
            gfh, gmh = rates(cos, same, guard, t)
            rows.append((t, fh, mh, gfh, gmh))
        curves[name] = rows
        record[name] = {"pairs": len(pairs), "same": int(same.sum()), "different": int((~same).sum()),
                        "curve": [dict(zip(("threshold", "false_hit", "missed_hit", "guarded_false_hit",
                                            "guarded_missed_hit"), r, strict=True)) for r in rows],
                        "guard_rejects_same": float((~guard[same]).mean()) if same.any() else None,
                        "guard_rejects_different": float((~guard[~same]).mean()) if (~same).any() else None}
        table = ["| threshold | false hits | missed hits | false hits, guarded | missed hits, guarded |",
                 "|---:|---:|---:|---:|---:|"]
        table += [f"| {t:.2f} | {fh:.1%} | {mh:.1%} | {gfh:.1%} | {gmh:.1%} |" for t, fh, mh, gfh, gmh in rows]
        lines.append(f"### {name}: {len(pairs)} pairs ({int(same.sum())} same-answer)\n\n" + "\n".join(table))
        if name == "fow-cache":
            shown = (0.92, 0.95, 0.97)
            cat_rows = ["| category | pairs | mean cosine | " + " | ".join(f"hits at {t}" for t in shown) + " | "
                        + " | ".join(f"hits at {t}, guarded" for t in shown) + " |",
                        "|---|---:|---:|" + "---:|" * (2 * len(shown))]
            for c in sorted({p[3] for p in pairs}):
                mask = np.array([p[3] == c for p in pairs])
                plain = [(cos[mask] >= t).mean() for t in shown]
                guarded = [((cos[mask] >= t) & guard[mask]).mean() for t in shown]
                cat_rows.append(f"| {c} ({'same' if same[mask][0] else 'different'}) | {int(mask.sum())} | "
                                f"{cos[mask].mean():.3f} | " + " | ".join(f"{v:.1%}" for v in plain + guarded) + " |")
            lines.append("### fow-cache by category\n\n" + "\n".join(cat_rows))
            record[name]["categories"] = cat_rows
    (args.out_dir / "threshold.json").write_text(json.dumps(record, indent=1))
    plot_threshold(curves, args.out_dir / "threshold.png")
    return "## The semantic cache's threshold\n\n" + "\n\n".join(lines)


def plot_threshold(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], curves.items(), strict=True):
        t = [r[0] for r in rows]
        ax.plot(t, [r[1] for r in rows], "r--", label="false hits")
        ax.plot(t, [r[2] for r in rows], "b--", label="missed hits")
        ax.plot(t, [r[3] for r in rows], "r-", label="false hits, guarded")
        ax.plot(t, [r[4] for r in rows], "b-", label="missed hits, guarded")
        ax.set_title(name)
        ax.set_xlabel("cosine threshold")
        ax.set_ylabel("rate")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_EMBEDDER: list = []


def embedder_once():
    """MiniLM as the gateway loads it, once for the parts that embed (threshold, routing)."""
    if not _EMBEDDER:
        from llmserve.embeddings import Embedder

        _EMBEDDER.append(Embedder())
    return _EMBEDDER[0]


# --- routing: a weak and a strong model on held-out HumanEval ------------------------------------------------------

SHARES = np.round(np.linspace(0.0, 1.0, 11), 2)


def learned_held_out(features: np.ndarray, labels: np.ndarray, folds: np.ndarray, l2: float,
                     shares: np.ndarray) -> np.ndarray:
    """[len(shares), n] bool: strong or not, each problem decided by a router trained without its fold."""
    from llmserve.gateway.routing.learned import fit_logistic, out_of_fold_scores, predict
    from llmserve.gateway.routing.router import threshold_for_share

    strong = np.zeros((len(shares), len(labels)), dtype=bool)
    for fold in np.unique(folds):
        test, train = folds == fold, folds != fold
        weights, bias = fit_logistic(features[train], labels[train], l2)
        calibration = out_of_fold_scores(features[train], labels[train], l2).tolist()  # as `train.py` writes it
        scores = predict(weights, bias, features[test])
        for i, share in enumerate(shares):
            strong[i, test] = scores > threshold_for_share(calibration, share)
    return strong


def scored_held_out(scores: np.ndarray, folds: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """The same for a router with fixed scores (the judge): thresholds from the other folds' scores."""
    from llmserve.gateway.routing.router import threshold_for_share

    strong = np.zeros((len(shares), len(scores)), dtype=bool)
    for fold in np.unique(folds):
        test = folds == fold
        calibration = scores[~test].tolist()
        for i, share in enumerate(shares):
            strong[i, test] = scores[test] > threshold_for_share(calibration, share)
    return strong


def apgr(quality: np.ndarray, q_weak: float, q_strong: float, shares: np.ndarray) -> float:
    pgr = (quality - q_weak) / (q_strong - q_weak)
    return float(np.trapezoid(pgr, shares) / (shares[-1] - shares[0]))


def curve(strong: np.ndarray, weak_pass: np.ndarray, strong_pass: np.ndarray, idx: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """(quality, actual strong share) per share level, over the problems `idx` (a bootstrap draw)."""
    chosen = strong[:, idx]
    quality = np.where(chosen, strong_pass[idx], weak_pass[idx]).mean(axis=1)
    return quality, chosen.mean(axis=1)


def _humaneval_results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["tasks"]["humaneval"]["results"]


def part_routing(args: argparse.Namespace) -> str:
    from llmserve.gateway.routing.train import humaneval_outcomes
    from llmserve.loader import load_tokenizer

    weak_file, strong_file = args.routing_dir / "humaneval_qwen0.5b.json", args.routing_dir / "humaneval_qwen1.5b.json"
    judge_file = args.routing_dir / "judge.json"
    weak, strong_outcomes = humaneval_outcomes(weak_file), humaneval_outcomes(strong_file)
    if [o.task_id for o in weak] != [o.task_id for o in strong_outcomes]:
        raise SystemExit("the two result files hold different problems")
    texts = [o.text for o in weak]
    weak_pass = np.array([o.passed for o in weak], dtype=float)
    strong_pass = np.array([o.passed for o in strong_outcomes], dtype=float)
    q_weak, q_strong = weak_pass.mean(), strong_pass.mean()
    n = len(texts)
    print(f"[gateway-bench] {n} problems: weak pass@1 {q_weak:.3f}, strong {q_strong:.3f}", flush=True)
    features = embedder_once().embed(texts).astype(np.float64)
    labels = 1.0 - weak_pass
    wins = (1 - weak_pass) * strong_pass  # RouteLLM's label: the strong model wins
    decisions: dict[str, list[np.ndarray]] = {"learned": [], "learned-wins": []}
    judge_scores = None
    if judge_file.exists():
        judge_scores = np.asarray(json.loads(judge_file.read_text())["calibration_scores"], dtype=float)
        decisions["judge"] = []
    decisions["length"] = []  # a baseline that needs no model: longer requests to the strong model
    lengths = np.array([len(t) for t in texts], dtype=float)
    rng = np.random.default_rng(0)
    for repeat in range(args.routing_repeats):
        folds = np.random.default_rng(repeat).permutation(n) % 4
        decisions["learned"].append(learned_held_out(features, labels, folds, 1.0, SHARES))
        decisions["learned-wins"].append(learned_held_out(features, wins, folds, 1.0, SHARES))
        if judge_scores is not None:
            decisions["judge"].append(scored_held_out(judge_scores, folds, SHARES))
        decisions["length"].append(scored_held_out(lengths, folds, SHARES))
    # random routing at each share: every problem strong with probability s, many draws
    decisions["random"] = [rng.random((len(SHARES), n)) < SHARES[:, None] for _ in range(args.routing_repeats * 20)]
    # the oracle: strong exactly where the weak model fails and the strong one passes (a bound, not a router)
    order = np.argsort(-wins + rng.random(n) * 1e-6)
    decisions["oracle"] = [np.stack([np.isin(np.arange(n), order[: round(s * n)]) for s in SHARES])]
    # tokens per request and answer, for cost (both models share Qwen2.5's tokenizer), at prices proportional to
    # the parameter count ($ per 1M output tokens, input at a quarter): the self-hosted cost on bandwidth-bound
    # hardware. An answer counts as the code `llmserve eval` kept of it.
    tokenizer = load_tokenizer("qwen2.5-coder-0.5b")
    prices = {"weak": 0.05, "strong": 0.15}
    out_tokens = {"weak": np.array([len(tokenizer.encode(r["completion"])) for r in _humaneval_results(weak_file)],
                                   dtype=float),
                  "strong": np.array([len(tokenizer.encode(r["completion"]))
                                      for r in _humaneval_results(strong_file)], dtype=float)}
    in_tokens = np.array([len(tokenizer.encode(t)) for t in texts], dtype=float)

    def cost(strong: np.ndarray) -> np.ndarray:
        per = {k: (in_tokens * p / 4 + out_tokens[k] * p) / 1e6 for k, p in prices.items()}
        return np.where(strong, per["strong"], per["weak"]).sum(axis=-1)

    report: dict = {"problems": n, "weak_pass_at_1": q_weak, "strong_pass_at_1": q_strong, "shares": SHARES.tolist(),
                    "folds": 4, "repeats": args.routing_repeats, "prices_per_million_output": prices, "routers": {}}
    all_idx = np.arange(n)
    boot = [rng.integers(0, n, n) for _ in range(args.bootstrap)]
    for name, runs in decisions.items():
        qualities, shares_actual = np.mean([curve(d, weak_pass, strong_pass, all_idx) for d in runs], axis=0)
        apgrs = []
        for idx in boot:
            qw, qs = weak_pass[idx].mean(), strong_pass[idx].mean()
            if qs == qw:
                continue
            q = np.mean([curve(d, weak_pass, strong_pass, idx)[0] for d in runs[:5]], axis=0)
            apgrs.append(apgr(q, qw, qs, SHARES))
        costs = np.mean([cost(d) for d in runs], axis=0)
        solved = qualities * n
        report["routers"][name] = {
            "quality": qualities.tolist(), "strong_share_actual": shares_actual.tolist(),
            "apgr": apgr(qualities, q_weak, q_strong, SHARES),
            "apgr_ci95": [float(np.percentile(apgrs, 2.5)), float(np.percentile(apgrs, 97.5))],
            "cost_per_solved": (costs / np.maximum(solved, 1)).tolist()}
    for name in [k for k in decisions if k not in ("random", "oracle")]:  # paired against random
        diffs = []
        for idx in boot:
            qw, qs = weak_pass[idx].mean(), strong_pass[idx].mean()
            if qs == qw:
                continue
            a = np.mean([curve(d, weak_pass, strong_pass, idx)[0] for d in decisions[name][:5]], axis=0)
            b = np.mean([curve(d, weak_pass, strong_pass, idx)[0] for d in decisions["random"][:20]], axis=0)
            diffs.append(apgr(a, qw, qs, SHARES) - apgr(b, qw, qs, SHARES))
        report["routers"][name]["apgr_minus_random_ci95"] = [float(np.percentile(diffs, 2.5)),
                                                             float(np.percentile(diffs, 97.5))]
    (args.out_dir / "routing.json").write_text(json.dumps(report, indent=1))
    plot_routing(report, args.out_dir / "routing.png")
    return "## Model routing on held-out HumanEval\n\n" + routing_table(report)


def routing_table(report: dict) -> str:
    routers = report["routers"]
    names = list(routers)
    lines = [f"HumanEval, {report['problems']} problems held out ({report['folds']}-fold, {report['repeats']} splits); "
             f"weak pass@1 {report['weak_pass_at_1']:.3f}, strong {report['strong_pass_at_1']:.3f}", "",
             "| strong share | " + " | ".join(f"{n} pass@1" for n in names) + " | "
             + " | ".join(f"{n} µ$/solved" for n in names if n != "oracle") + " |",
             "|---:|" + "---:|" * (2 * len(names) - 1)]
    for i, share in enumerate(report["shares"]):
        cells = [f"{routers[n]['quality'][i]:.3f}" for n in names]
        cells += [f"{routers[n]['cost_per_solved'][i] * 1e6:.1f}" for n in names if n != "oracle"]
        lines.append(f"| {share:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "| router | APGR | 95 % CI | APGR - random, 95 % CI |", "|---|---:|---:|---:|"]
    for n in names:
        r = routers[n]
        diff = r.get("apgr_minus_random_ci95")
        lines.append(f"| {n} | {r['apgr']:.3f} | {r['apgr_ci95'][0]:.3f} .. {r['apgr_ci95'][1]:.3f} | "
                     + (f"{diff[0]:+.3f} .. {diff[1]:+.3f}" if diff else "-") + " |")
    return "\n".join(lines)


def plot_routing(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in report["routers"].items():
        style = {"random": "k--", "oracle": "g:"}.get(name, "-o")
        ax.plot(report["shares"], r["quality"], style, label=f"{name} (APGR {r['apgr']:.2f})")
    ax.set_xlabel("share of requests sent to the strong model")
    ax.set_ylabel("HumanEval pass@1 (held out)")
    ax.set_title("Routing qwen2.5-coder 0.5B / 1.5B")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="prefix,overhead",
                    help="comma list of prefix, overhead, cache, threshold, routing (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8060)
    ap.add_argument("--prefix-len", type=int, default=400)
    ap.add_argument("--kv-gb", type=float, default=0.12, help="prefix part: each replica's KV cache")
    ap.add_argument("--concurrency", type=int, default=4, help="prefix and cache parts")
    ap.add_argument("--pairs", type=int, default=200, help="overhead part: paired TTFT probes")
    ap.add_argument("--throughput-concurrency", type=int, default=64, help="overhead part: the throughput level")
    ap.add_argument("--throughput-requests", type=int, default=128, help="overhead part: its requests")
    ap.add_argument("--output-len", type=int, default=128, help="overhead part: output tokens of its requests")
    ap.add_argument("--num-requests", type=int, default=64, help="prefix part")
    ap.add_argument("--pairs-limit", type=int, default=0, help="threshold part: a sample of each set (0: all)")
    ap.add_argument("--routing-dir", type=Path, default=None,
                    help="routing part: the folder of the HumanEval and judge files (default: the out dir)")
    ap.add_argument("--routing-repeats", type=int, default=5, help="routing part: fold splits (seeds)")
    ap.add_argument("--bootstrap", type=int, default=1000, help="routing part: bootstrap draws")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest run of each part asked for: seconds, not minutes; figures meaningless")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "gateway")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.pairs, args.num_requests, args.concurrency = 1, 4, 4, 2
        args.throughput_concurrency, args.throughput_requests, args.output_len = 2, 2, 8
        args.pairs_limit, args.routing_repeats, args.bootstrap = 64, 1, 20
    args.routing_dir = args.routing_dir or args.out_dir
    args.out_dir.mkdir(parents=True, exist_ok=True)
    m = machine_facts()
    parts = {"prefix": part_prefix, "overhead": part_overhead, "cache": part_cache, "threshold": part_threshold,
             "routing": part_routing}
    for part in args.parts.split(","):
        body = parts[part](args)
        report = (f"# Gateway: {part}\n\nGenerated {time.strftime('%Y-%m-%d %H:%M')} by `benchmarks/gateway.py "
                  f"--parts {part}`; {m['cpu']}, {m['cpus']} CPUs.\n\n{body}\n")
        (args.out_dir / f"{part}.md").write_text(report)
        print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
