#!/usr/bin/env python3
"""Speculative decoding off vs on, served: one `llmserve serve` per variant, the same `llmserve bench`
workloads against each, one after the other on this machine's cores, one table of ratios and a plot.

    .venv/bin/python benchmarks/spec_decode.py                        # smollm2: code-edit and chat, c=1 and 32
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
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import TreeMemory, machine_facts, port_free, stop_group  # noqa: E402

from llmserve.bench.report import compare_table, load_result, plot_results  # noqa: E402


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
    import urllib.request

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


def bench(name: str, workload: str, args: argparse.Namespace) -> Path:
    out = args.out_dir / f"spec_{name}_{workload}.json"
    levels = [level.split(":") for level in args.levels.split(",")]
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", f"http://127.0.0.1:{args.port}",
           "--workload", workload, "--output-len", str(args.output_len), "--temperature", "0", "--no-ignore-eos",
           "--seed", "1234", "--concurrency", ",".join(c for c, _ in levels),
           "--num-requests", ",".join(n for _, n in levels), "--warmup", "2", "--label", f"{name} {workload}",
           "--out", str(out), "--no-progress"]
    subprocess.check_call(cmd, cwd=REPO)
    return out


def metrics(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("llmserve:spec_decode"):
            key, value = line.rsplit(" ", 1)
            out[key.split("{")[0].removeprefix("llmserve:spec_decode_")] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="code-edit,chat")
    ap.add_argument("--levels", default="1:16,32:64", help="concurrency:requests,... (default %(default)s)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON")
    ap.add_argument("--serve-flags", default="", help="flags for every variant's `llmserve serve`")
    ap.add_argument("--port", type=int, default=8030)
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = [("off", None), ("on", json.dumps({"method": "ngram"}))]
    variants += [tuple(v.split("=", 1)) for v in args.variant]
    workloads = args.workloads.split(",")
    results: dict[str, dict[str, Path]] = {w: {} for w in workloads}
    spec_counts: dict[str, dict[str, dict[str, float]]] = {}
    for name, spec in variants:
        if not port_free(args.port):
            raise SystemExit(f"port {args.port} is busy")
        proc, pgid, mem = serve(name, spec, args)
        try:
            for workload in workloads:
                before = metrics(args.port)
                results[workload][name] = bench(name, workload, args)
                after = metrics(args.port)
                spec_counts.setdefault(workload, {})[name] = {k: after[k] - before.get(k, 0.0) for k in after
                                                              if k.endswith("_total")}
        finally:
            mem.stop_event.set()
            stop_group(proc, pgid)
    m = machine_facts()
    parts = [f"# Speculative decoding off vs on ({args.model}, served)",
             f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `benchmarks/spec_decode.py`; {m['cpu']}, "
             f"{m['cpus']} CPUs; levels {args.levels} (concurrency:requests), temperature 0, EOS honoured, at most "
             f"{args.output_len} output tokens; times in ms."]
    for workload in workloads:
        docs = [load_result(results[workload][name]) for name, _ in variants]
        docs = [{**d, "engine": name} for d, (name, _) in zip(docs, variants, strict=True)]
        parts.append(f"## {workload}\n\n" + compare_table(docs, markdown=True))
        for name, counts in spec_counts.get(workload, {}).items():
            drafts, proposed = counts.get("num_drafts_total", 0), counts.get("num_draft_tokens_total", 0)
            accepted = counts.get("num_accepted_tokens_total", 0)
            if drafts:
                parts.append(f"- {name}: {proposed:.0f} proposal tokens in {drafts:.0f} verifications, "
                             f"{accepted:.0f} kept ({accepted / proposed:.1%}), mean acceptance length "
                             f"{1 + accepted / drafts:.2f}")
        plot_results(docs, args.out_dir / f"spec_decode_{workload}.png", [name for name, _ in variants])
    report = "\n\n".join(parts) + "\n"
    (args.out_dir / "spec_decode.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
