#!/usr/bin/env python3
"""Speculative decoding off against on, served: one `llmserve serve` per variant, the same `llmserve bench`
workloads against each, one after the other on this machine's cores, one table of ratios and a plot per workload.

    .venv/bin/python benchmarks/spec_decode.py --rounds 2 --levels 1:8,32:32      # smollm2, n-gram, ABBA rounds
    .venv/bin/python benchmarks/spec_decode.py --rounds 2 --levels 1:8,2:8,4:16,8:32 --no-ngram --variant default=auto
    .venv/bin/python benchmarks/spec_decode.py --model qwen2.5-coder-1.5b --workloads humaneval --levels 1:8 \
        --rounds 3 --no-ngram --variant 'draft={"method": "draft_model", "model": "qwen2.5-coder-0.5b"}' \
        --llama-cpp --llama-cpp-draft qwen2.5-coder-0.5b                         # beside llama.cpp's own drafts
    .venv/bin/python benchmarks/spec_decode.py --workloads chat --levels 1:1 --output-len 8 --warmup 0 --no-ngram \
        --out-dir /tmp/spec                                                       # a smoke run: one server

Why: speculation pays where a step of k + 1 tokens costs little more than a step of one (decode bound by memory),
and loses where it does not (compute-bound hosts, large batches); the server's default (`auto`: n-gram prompt
lookup, or a registered draft model, while fewer than 4 requests run) was chosen on these runs.
docs/performance.md, "Speculative decoding", has them.

Variants: "off" (`--speculative-config off`) and "on" ({"method": "ngram"}: the adaptive speculator at every load;
left out by --no-ngram), plus any --variant NAME=JSON ("auto" is the server's default). With --llama-cpp, llama.cpp's
own `llama-server` (the peers' build under $PEERS, one slot per concurrent request) on the same GGUF file joins as
"llama.cpp", and with --llama-cpp-draft MODEL as "llama.cpp-draft" (`--model-draft --spec-type draft-simple`).
Workloads: code-edit (functions of Python's standard library, an edit that repeats most of them), chat (MT-Bench
first turns) and humaneval (the problems as `llmserve eval` asks them); temperature 0, EOS honoured (answers end
where the model ends them: a model looping past its answer would flatter prompt lookup), --output-len tokens at
most. Greedy output is the same in every llmserve variant, so output tok/s compare directly. With --rounds > 1 the
variants run in ABBA order and the ratio to the first variant is taken per round (the host drifts over minutes).
Writes <out-dir>/spec_<variant>_<workload>.json, spec_decode.md and spec_decode_<workload>.png (default out dir:
benchmarks/results/spec-decode/<host>/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import TreeMemory, find_shared_peers, host_tag, machine_facts, port_free, stop_group  # noqa: E402

from llmserve.bench.report import compare_table, load_result, plot_results, render_table, summary_table  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """One server to measure: an llmserve with a speculative config (None: off), or llama.cpp's."""

    name: str
    spec: str | None = None
    llama_cpp_draft: str | None = None  # a llama.cpp variant: "" without a draft, else the draft's GGUF
    llama_cpp: bool = False

    def command(self, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
        if self.llama_cpp:
            slots = max(int(c) for c, _ in (level.split(":") for level in args.levels.split(",")))
            shared = find_shared_peers()
            if shared is None:
                raise SystemExit("llama.cpp runs from the peers' scripts (shared/peers), not found")
            cmd = [str(shared / "servers" / "llama_server.sh"), "-m", model_file(args.model),
                   "--alias", args.model, "-c", str(slots * args.context_per_slot)]
            if self.llama_cpp_draft:  # without --spec-type, llama-server loads the draft and never uses it
                cmd += ["--model-draft", self.llama_cpp_draft, "--spec-type", "draft-simple"]
            return cmd, {"NP": str(slots), "PORT": str(args.port)}
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
               "--port", str(args.port), "--no-access-log", *args.serve_flags.split()]
        if self.spec:
            cmd += ["--speculative-config", self.spec]
        return cmd, {}


def model_file(model: str) -> str:
    """The GGUF file a registered name (or a path) stands for: llama.cpp serves the very file we load."""
    from llmserve.loader.default_models import resolve_model_path

    path, _ = resolve_model_path(model)
    if not path.endswith(".gguf"):
        raise SystemExit(f"llama.cpp needs a GGUF file; {model} is {path}")
    return path


def serve(variant: Variant, args: argparse.Namespace) -> tuple[subprocess.Popen, int, TreeMemory]:
    name = variant.name
    cmd, env = variant.command(args)
    log = (args.out_dir / f"spec_{name}.server.log").open("w")
    print(f"[spec] {name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**os.environ, **env})
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
           "--num-requests", ",".join(n for _, n in levels), "--warmup", str(args.warmup),
           "--label", f"{name} {workload}", "--out", str(out), "--no-progress"]
    subprocess.check_call(cmd, cwd=REPO)
    return out


def metrics(port: int) -> dict[str, float]:
    """The llmserve:spec_decode_* samples, by name without the prefix (none from a server without them)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    except urllib.error.HTTPError:  # llama-server without --metrics
        return {}
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
    ap.add_argument("--no-ngram", action="store_true", help='leave out the "on" (n-gram) variant')
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's llama-server on the same file")
    ap.add_argument("--llama-cpp-draft", default=None, metavar="MODEL",
                    help="add llama-server with --model-draft MODEL's GGUF (its own default draft settings)")
    ap.add_argument("--context-per-slot", type=int, default=2048, help="llama-server context per slot")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before each bench run")
    ap.add_argument("--port", type=int, default=8030)
    ap.add_argument("--out-dir", type=Path, default=None, help="default benchmarks/results/spec-decode/<host>")
    args = ap.parse_args()
    args.out_dir = args.out_dir or REPO / "benchmarks" / "results" / "spec-decode" / host_tag()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = [Variant("off", "off")] + ([] if args.no_ngram else [Variant("on", json.dumps({"method": "ngram"}))])
    variants += [Variant(*v.split("=", 1)) for v in args.variant]
    if args.llama_cpp:
        variants.append(Variant("llama.cpp", llama_cpp=True))
    if args.llama_cpp_draft:
        variants.append(Variant("llama.cpp-draft", llama_cpp=True, llama_cpp_draft=model_file(args.llama_cpp_draft)))
    names = [v.name for v in variants]
    workloads = args.workloads.split(",")
    results: dict[str, dict[str, list[Path]]] = {w: {name: [] for name in names} for w in workloads}
    spec_counts: dict[str, dict[str, dict[str, float]]] = {w: {} for w in workloads}
    for round_ in range(args.rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            name = variant.name
            if not port_free(args.port):
                raise SystemExit(f"port {args.port} is busy")
            proc, pgid, mem = serve(variant, args)
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
        table = (compare_table(docs, markdown=True) if len(docs) > 1 else  # one variant: its own figures
                 summary_table(docs[0]["summary"], markdown=True))
        parts.append(f"## {workload}" + (" (round 1)" if args.rounds > 1 else "") + "\n\n" + table)
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
