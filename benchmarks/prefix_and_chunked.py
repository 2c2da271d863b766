#!/usr/bin/env python3
"""Prefix caching and chunked prefill, measured through the server with `llmserve bench`.

Three comparisons, each between two server configurations started back to back, same workload:
1. shared-prefix (400-token shared system prompt), c=1 and c=8: TTFT p50, prefix cache on vs off.
2. long-prompt-mix at c=16 (10 % of requests have 2,000-token prompts): ITL p99 and throughput,
   chunked prefill (default budget) vs one-step prefill (budget and threshold above the longest prompt).
3. random prompts, all distinct (0 % hits), c=8: throughput, prefix cache on vs off (its overhead).

    .venv/bin/python benchmarks/prefix_and_chunked.py        # ~10 minutes on 2 cores
Writes benchmarks/results/prefix_chunked_*.json and prints a markdown summary.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
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
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    tok = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    n = 8 if args.quick else 24
    lines = ["| comparison | metric | A | B | B / A |", "|---|---|---:|---:|---:|"]

    # 1. prefix cache, TTFT
    on, off = run_pair([], ["--no-enable-prefix-caching"], ("prefix_on", "prefix_off"), [
        "--workload", "shared-prefix", "--prefix-len", "400", "--input-len", "450", "--output-len", "32",
        "--concurrency", "1,8", "--num-requests", f"{n},{2 * n}", "--warmup", "2", *tok])
    for lo, lf in zip(levels(on), levels(off), strict=True):
        a, b = lo["ttft_p50_ms"], lf["ttft_p50_ms"]
        lines.append(f"| prefix cache on (A) vs off (B), c={lo['concurrency']} | TTFT p50 ms | {a:.0f} | {b:.0f} "
                     f"| {b / a:.2f}x ({1 - a / b:.0%} lower with cache) |")

    # 2. chunked prefill, ITL p99 under long prompts
    chunked, whole = run_pair([], ["--max-num-batched-tokens", "4096", "--long-prefill-token-threshold", "4096"],
                              ("chunked", "unchunked"), [
        "--workload", "long-prompt-mix", "--long-input-len", "2000", "--input-len", "128", "--output-len", "64",
        "--concurrency", "16", "--num-requests", str(3 * n), "--warmup", "2", *tok])
    lc, lw = levels(chunked)[0], levels(whole)[0]
    lines.append(f"| chunked (A) vs one-step prefill (B), c=16 | ITL p99 ms | {lc['itl_p99_ms']:.0f} | "
                 f"{lw['itl_p99_ms']:.0f} | {lw['itl_p99_ms'] / lc['itl_p99_ms']:.2f}x |")
    lines.append(f"| chunked (A) vs one-step prefill (B), c=16 | output tok/s | {lc['output_tok_per_s']:.1f} | "
                 f"{lw['output_tok_per_s']:.1f} | {lw['output_tok_per_s'] / lc['output_tok_per_s']:.2f}x |")

    # 3. prefix cache overhead at 0 % hits
    on0, off0 = run_pair([], ["--no-enable-prefix-caching"], ("nohit_on", "nohit_off"), [
        "--workload", "random", "--input-len", "256", "--output-len", "64", "--concurrency", "8",
        "--num-requests", str(2 * n), "--warmup", "2", *tok])
    a, b = levels(on0)[0]["output_tok_per_s"], levels(off0)[0]["output_tok_per_s"]
    lines.append(f"| 0 % hits: cache on (A) vs off (B), c=8 | output tok/s | {a:.1f} | {b:.1f} | {b / a:.2f}x |")

    table = "\n".join(lines)
    print("\n" + table)
    (RESULTS / "prefix_chunked_summary.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
