#!/usr/bin/env python3
"""int4 methods side by side: round to nearest, AWQ and GPTQ on the same groups, from the same weights.

    .venv/bin/python benchmarks/int4_methods.py                                   # SmolLM2, groups of 32
    .venv/bin/python benchmarks/int4_methods.py --model qwen2.5-coder-0.5b --group-sizes 128 \
        --tasks perplexity,humaneval --calibration my-text.txt
    .venv/bin/python benchmarks/int4_methods.py --methods int4 --ppl-tokens 256 --out /tmp/m   # a smoke run

Why: which method to quantize a model with depends on the model and on the calibration text (GPTQ fits each weight
to its calibration inputs: docs/quantization.md, "GPTQ"), so the answer is a measurement, not a rule. Each method runs
`llmserve quantize` (timed: the quantization time), then `llmserve eval` on the written directory (perplexity on
the Lee corpus with dense large steps, so every scored token computes with the written values; HumanEval pass@1 if
asked), beside the unquantized model (`--quantization none`). All three write groups our int4 kernels run alike, so
the served speed is the int4 path's (docs/performance.md). Writes <out>.json and <out>.md (default
benchmarks/results/weight-quality/int4-methods-<model>-<host>).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_vs_peers import host_tag  # noqa: E402

LLMSERVE = [sys.executable, "-m", "llmserve.cli"]
METHODS = ("int4", "awq", "gptq")
NAMES = {"int4": "round to nearest", "awq": "AWQ", "gptq": "GPTQ"}


def evaluate(target: str, tasks: str, ppl_tokens: int, extra: list[str]) -> dict:
    """{"perplexity", "humaneval"} (those asked for) of a model or a written directory, by `llmserve eval` (`extra`:
    its options; default dense large steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        subprocess.run([*LLMSERVE, "eval", target, "--tasks", tasks, "--ppl-tokens", str(ppl_tokens),
                        "--out", str(out), *(extra or ["--large-steps", "dense"])], check=True,
                       stdout=subprocess.DEVNULL)
        found = json.loads(out.read_text())["tasks"]
    return {"perplexity": found.get("perplexity", {}).get("perplexity"),
            "humaneval": found.get("humaneval", {}).get("pass_at_1")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default=",".join(METHODS), help="of " + ", ".join(METHODS))
    parser.add_argument("--group-sizes", default="32")
    parser.add_argument("--tasks", default="perplexity")
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--calibration", default=None, help="awq, gptq: the text to calibrate on (default: ours)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}")
    out = Path(args.out or REPO / "benchmarks/results/weight-quality" / f"int4-methods-{args.model}-{host_tag()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[1/{1 + len(methods) * len(args.group_sizes.split(','))}] {args.model} unquantized", flush=True)
    rows = [{"method": "unquantized", "group_size": None, "seconds": None,
             **evaluate(args.model, args.tasks, args.ppl_tokens, ["--quantization", "none"])}]
    step = 1
    for group_size in args.group_sizes.split(","):
        for method in methods:
            step += 1
            print(f"[{step}/{1 + len(methods) * len(args.group_sizes.split(','))}] {NAMES[method]}, groups of "
                  f"{group_size}", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                calibration = (["--calibration", args.calibration] if args.calibration and method != "int4"
                               else [])
                start = time.perf_counter()
                subprocess.run([*LLMSERVE, "quantize", args.model, "--method", method, "--group-size", group_size,
                                *calibration, "--out", tmp], check=True, stdout=subprocess.DEVNULL)
                seconds = time.perf_counter() - start
                rows.append({"method": method, "group_size": int(group_size), "seconds": round(seconds, 1),
                             **evaluate(tmp, args.tasks, args.ppl_tokens, [])})
    base = rows[0]["perplexity"]
    result = {"model": args.model, "host": host_tag(), "date": time.strftime("%Y-%m-%d"), "tasks": args.tasks,
              "ppl_tokens": args.ppl_tokens, "calibration": args.calibration or "llmserve/quantization/calibration.txt",
              "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{args.model}, host {host_tag()}, {result['date']}; perplexity on the Lee corpus ({args.ppl_tokens} "
             f"tokens, dense large steps); calibration: {result['calibration']}.", "",
             "| weights | group | perplexity | vs unquantized | HumanEval pass@1 | quantize s |",
             "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        ppl, humaneval = row["perplexity"], row["humaneval"]
        cells = [NAMES.get(row["method"], row["method"]), row["group_size"] or "-",
                 "" if ppl is None else f"{ppl:.4f}",
                 "" if ppl is None or not base else f"{100 * (ppl / base - 1):+.2f} %",
                 "" if humaneval is None else f"{humaneval:.3f}", "-" if row["seconds"] is None else row["seconds"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
