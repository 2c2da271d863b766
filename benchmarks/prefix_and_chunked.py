#!/usr/bin/env python3
"""Prefix caching and chunked prefill, measured through the server with `llmserve bench`.

Three comparisons, each between two server configurations started back to back, same workload:
1. shared-prefix (400-token shared system prompt), c=1 and c=8: TTFT p50, prefix cache on vs off.
2. long-prompt-mix at c=16 (`llmserve bench` defaults: 256-token prompts, 128 out, one in ten prompts
   2,048 tokens): ITL p99 and throughput, chunked prefill (default budget) vs one-step prefill (budget
   and threshold above the longest prompt).
3. random prompts, all distinct (0 % hits), c=8: throughput, prefix cache on vs off (its overhead).
And one offline, in-process: 4. 16 requests decoding when a 2,000-token prompt arrives: the longest
gap their streams see, and that prompt's time to first token, chunked vs one-step prefill.

    .venv/bin/python benchmarks/prefix_and_chunked.py                  # ~20 minutes on 2 cores
    .venv/bin/python benchmarks/prefix_and_chunked.py --only chunked,stall
Writes benchmarks/results/prefix_chunked_*.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [PY, "-m", "llmserve.cli", "serve", "--port", str(port), "--kv-cache-memory-gb", "1",
           "--max-model-len", "4096", *extra]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(url: str, name: str, args: list[str]) -> dict:
    out = RESULTS / f"prefix_chunked_{name}.json"
    cmd = [PY, "-m", "llmserve.cli", "bench", "--base-url", url, "--out", str(out), "--label", name,
           "--no-progress", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(out) as f:
        return json.load(f)


def levels(result: dict) -> list[dict]:
    return [lv["summary"] for lv in result["levels"]]


def run_pair(server_a: list[str], server_b: list[str], names: tuple[str, str], bench_args: list[str]):
    results = []
    for extra, name in zip((server_a, server_b), names, strict=True):
        proc, url = start_server(extra)
        try:
            results.append(bench(url, name, bench_args))
        finally:
            stop_server(proc)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer for exact prompt lengths")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--only", default="prefix,chunked,nohit,stall", help="comma-separated parts to run")
    ap.add_argument("--chunked-flags", default="", help="serve flags of the chunked side (default: the defaults)")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    RESULTS.mkdir(parents=True, exist_ok=True)
    tok = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    n = 8 if args.quick else 24
    lines = ["| comparison | metric | A | B | B / A |", "|---|---|---:|---:|---:|"]

    # 1. prefix cache, TTFT
    if "prefix" in parts:
        lines += prefix_ttft(n, tok)
    if "chunked" in parts:
        lines += chunked_itl(n, tok, args.chunked_flags.split())
    if "nohit" in parts:
        lines += no_hit_overhead(n, tok)
    if "stall" in parts:
        lines += stall_offline()

    table = "\n".join(lines)
    print("\n" + table)
    (RESULTS / f"prefix_chunked_summary_{'_'.join(sorted(parts))}.md").write_text(table + "\n")


def prefix_ttft(n: int, tok: list[str]) -> list[str]:
    lines = []
    on, off = run_pair([], ["--no-enable-prefix-caching"], ("prefix_on", "prefix_off"), [
        "--workload", "shared-prefix", "--prefix-len", "400", "--input-len", "450", "--output-len", "32",
        "--concurrency", "1,8", "--num-requests", f"{n},{2 * n}", "--warmup", "2", *tok])
    for lo, lf in zip(levels(on), levels(off), strict=True):
        a, b = lo["ttft_p50_ms"], lf["ttft_p50_ms"]
        lines.append(f"| prefix cache on (A) vs off (B), c={lo['concurrency']} | TTFT p50 ms | {a:.0f} | {b:.0f} "
                     f"| {b / a:.2f}x ({1 - a / b:.0%} lower with cache) |")

    return lines


def chunked_itl(n: int, tok: list[str], chunked_flags: list[str]) -> list[str]:
    lines = []
    one_step = ["--max-num-batched-tokens", "4096", "--long-prefill-token-threshold", "4096"]
    chunked, whole = run_pair(chunked_flags, one_step, ("chunked", "unchunked"), [
        "--workload", "long-prompt-mix", "--concurrency", "16", "--num-requests", str(3 * n), "--warmup", "2", *tok])
    lc, lw = levels(chunked)[0], levels(whole)[0]
    lines.append(f"| chunked (A) vs one-step prefill (B), c=16 | ITL p99 ms | {lc['itl_p99_ms']:.0f} | "
                 f"{lw['itl_p99_ms']:.0f} | {lw['itl_p99_ms'] / lc['itl_p99_ms']:.2f}x |")
    lines.append(f"| chunked (A) vs one-step prefill (B), c=16 | output tok/s | {lc['output_tok_per_s']:.1f} | "
                 f"{lw['output_tok_per_s']:.1f} | {lw['output_tok_per_s'] / lc['output_tok_per_s']:.2f}x |")

    return lines


def no_hit_overhead(n: int, tok: list[str]) -> list[str]:
    lines = []
    on0, off0 = run_pair([], ["--no-enable-prefix-caching"], ("nohit_on", "nohit_off"), [
        "--workload", "random", "--input-len", "256", "--output-len", "64", "--concurrency", "8",
        "--num-requests", str(2 * n), "--warmup", "2", *tok])
    a, b = levels(on0)[0]["output_tok_per_s"], levels(off0)[0]["output_tok_per_s"]
    lines.append(f"| 0 % hits: cache on (A) vs off (B), c=8 | output tok/s | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    return lines


def stall_offline() -> list[str]:
    """The issue's scenario in-process: no HTTP, no client, just the engine's step times."""
    from llmserve import LLM, SamplingParams

    rng = random.Random(0)
    decode = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    first_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = {}
    for name, budget in (("chunked", None), ("unchunked", 4096)):
        kwargs = {} if budget is None else {"max_num_batched_tokens": budget, "long_prefill_token_threshold": budget}
        llm = LLM(kv_cache_memory_gb=1, max_model_len=4096, enable_prefix_caching=False, **kwargs)
        engine = llm.engine
        for i in range(16):
            engine.add_request(f"d{i}", [rng.randrange(100, 40000) for _ in range(128)], decode)
        for _ in range(8):
            engine.step()
        gaps, ttfts = [], []
        for rep in range(3):
            rid = f"long{rep}"
            engine.add_request(rid, [rng.randrange(100, 40000) for _ in range(2000)], first_token)
            t0 = time.perf_counter()
            while rid in engine.requests:
                s = time.perf_counter()
                engine.step()
                gaps.append(time.perf_counter() - s)  # every step carries all 16 decodes
            ttfts.append(time.perf_counter() - t0)
            for _ in range(4):
                s = time.perf_counter()
                engine.step()
                gaps.append(time.perf_counter() - s)
        rows[name] = (max(gaps) * 1000, statistics.median(ttfts) * 1000)
        print(f"stall {name}: longest decode gap {rows[name][0]:.0f} ms, 2,000-token TTFT p50 {rows[name][1]:.0f} ms",
              flush=True)
        del llm, engine
    (c_gap, c_ttft), (u_gap, u_ttft) = rows["chunked"], rows["unchunked"]
    return [f"| offline: 16 decodes + a 2,000-token prompt, chunked (A) vs one-step (B) | longest decode gap ms "
            f"| {c_gap:.0f} | {u_gap:.0f} | {u_gap / c_gap:.2f}x |",
            f"| offline: same | TTFT of the 2,000-token prompt ms | {c_ttft:.0f} | {u_ttft:.0f} "
            f"| {u_ttft / c_ttft:.2f}x |"]


if __name__ == "__main__":
    main()
