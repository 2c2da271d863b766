#!/usr/bin/env python3
"""Speculative decoding off vs on, served: one `llmserve serve` per variant, the same `llmserve bench`
workloads against each, one after the other on this machine's cores, one table of ratios and a plot.

    .venv/bin/python benchmarks/spec_decode.py                        # smollm2: code-edit and chat, c=1 and 32
    .venv/bin/python benchmarks/spec_decode.py --rounds 2 --levels 32:32  # ABBA, ratios per round
    .venv/bin/python benchmarks/spec_decode.py --workloads code-edit --levels 1:8 --variant \
        'fixed-k4={"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'

Variants: "off" (no flag: the default server) and "on" ({"method": "ngram"}: the adaptive speculator), plus
any --variant NAME=JSON. Workloads: code-edit (functions of Python's standard library, an edit that repeats
most of them) and chat (MT-Bench first turns); temperature 0, EOS honoured (answers end where the model ends
them: a model looping past its answer would flatter prompt lookup), --output-len tokens at most. Greedy
output is the same in every variant, so output tok/s compare directly. Writes
benchmarks/results/spec_<variant>_<workload>.json, spec_decode.md and spec_decode.png (--out-dir).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import TreeMemory, machine_facts, port_free, stop_group  # noqa: E402

from llmserve.bench.report import compare_table, load_result, plot_results, render_table  # noqa: E402


def serve(name: str, spec: str | None, args: argparse.Namespace) -> tuple[subprocess.Popen, int, TreeMemory]:
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(args.port), "--no-access-log", *args.serve_flags.split()]
    if spec:
        cmd += ["--speculative-config", spec]
    log = (args.out_dir / f"spec_{name}.server.log").open("w")
    print(f"[spec] {name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    mem = TreeMemory(proc.pid)
    mem.start()
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: server exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, proc.pid, mem
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name}: not ready after 900 s")


def bench(name: str, workload: str, args: argparse.Namespace, suffix: str = "") -> Path:
    out = args.out_dir / f"spec_{name}_{workload}{suffix}.json"
    levels = [level.split(":") for level in args.levels.split(",")]
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", f"http://127.0.0.1:{args.port}",
           "--workload", workload, "--output-len", str(args.output_len), "--temperature", "0", "--no-ignore-eos",
           "--seed", "1234", "--concurrency", ",".join(c for c, _ in levels),
           "--num-requests", ",".join(n for _, n in levels), "--warmup", "2", "--label", f"{name} {workload}",
           "--out", str(out), "--no-progress"]
    subprocess.check_call(cmd, cwd=REPO)
    return out


def metrics(port: int) -> dict[str, float]:
    """The llmserve:spec_decode_* samples, by name without the prefix."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {sample.name.removeprefix("llmserve:spec_decode_"): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("llmserve:spec_decode")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="code-edit,chat")
    ap.add_argument("--levels", default="1:16,32:64", help="concurrency:requests,... (default %(default)s)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every variant, in ABBA order: the host "
                    "drifts over minutes, so ratios are taken per round and their median reported")
    ap.add_argument("--serve-flags", default="", help="flags for every variant's `llmserve serve`")
    ap.add_argument("--port", type=int, default=8030)
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = [("off", None), ("on", json.dumps({"method": "ngram"}))]
    variants += [tuple(v.split("=", 1)) for v in args.variant]
    names = [name for name, _ in variants]
    workloads = args.workloads.split(",")
    results: dict[str, dict[str, list[Path]]] = {w: {name: [] for name in names} for w in workloads}
    spec_counts: dict[str, dict[str, dict[str, float]]] = {w: {} for w in workloads}
    for round_ in range(args.rounds):
        for name, spec in variants if round_ % 2 == 0 else variants[::-1]:
            if not port_free(args.port):
                raise SystemExit(f"port {args.port} is busy")
            proc, pgid, mem = serve(name, spec, args)
            try:
                for workload in workloads:
                    before = metrics(args.port)
                    out = bench(name, workload, args, f"_r{round_ + 1}" if args.rounds > 1 else "")
                    results[workload][name].append(out)
                    after = metrics(args.port)
                    counts = spec_counts[workload].setdefault(name, {})
                    for k in after:
                        counts[k] = counts.get(k, 0.0) + after[k] - before.get(k, 0.0)
            finally:
                mem.stop_event.set()
                stop_group(proc, pgid)
    m = machine_facts()
    parts = [f"# Speculative decoding off vs on ({args.model}, served)",
             f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `benchmarks/spec_decode.py`; {m['cpu']}, "
             f"{m['cpus']} CPUs; levels {args.levels} (concurrency:requests), temperature 0, EOS honoured, at most "
             f"{args.output_len} output tokens, {args.rounds} round(s) (ABBA order); times in ms."]
    for workload in workloads:
        docs = [{**load_result(results[workload][name][0]), "engine": name} for name in names]
        if args.rounds > 1:
            parts.append(f"## {workload}: output tok/s per round\n\n" + rounds_table(results[workload], names))
        parts.append(f"## {workload}" + (" (round 1)" if args.rounds > 1 else "") + "\n\n"
                     + compare_table(docs, markdown=True))
        for name, counts in spec_counts[workload].items():
            drafts, proposed = counts.get("num_drafts_total", 0), counts.get("num_draft_tokens_total", 0)
            accepted = counts.get("num_accepted_tokens_total", 0)
            if drafts:
                parts.append(f"- {name}: {proposed:.0f} proposal tokens in {drafts:.0f} verifications, "
                             f"{accepted:.0f} kept ({accepted / proposed:.1%}), mean acceptance length "
                             f"{1 + accepted / drafts:.2f}")
        plot_results(docs, args.out_dir / f"spec_decode_{workload}.png", names)
    report = "\n\n".join(parts) + "\n"
    (args.out_dir / "spec_decode.md").write_text(report)
    print(report)
    return 0


def rounds_table(paths: dict[str, list[Path]], names: list[str]) -> str:
    """Per level: each variant's output tok/s in every round, and the median over rounds of its ratio to the
    first variant's in the same round."""
    per = {name: [{s["concurrency"]: s["output_tok_per_s"] for s in load_result(p)["summary"]} for p in runs]
           for name, runs in paths.items()}
    base = names[0]
    rows = []
    for level in per[base][0]:
        for name in names:
            values = [r[level] for r in per[name]]
            ratios = [v / b[level] for v, b in zip(values, per[base], strict=True)]
            rows.append([f"c={level}", name, *(f"{v:.1f}" for v in values), f"{statistics.median(ratios):.2f}x"])
    headers = ["level", "variant", *(f"round {i + 1}" for i in range(len(per[base]))), f"median / {base}"]
    return render_table(headers, rows, markdown=True, left=2)


if __name__ == "__main__":
    raise SystemExit(main())
