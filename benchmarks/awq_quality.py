"""AWQ against round to nearest on the same int4 groups: perplexity (and HumanEval pass@1) per group size.

    .venv/bin/python benchmarks/awq_quality.py          # smollm2-135m (groups 32, 64), qwen2.5-coder-0.5b (32, 128)
    .venv/bin/python benchmarks/awq_quality.py --models qwen2.5-coder-0.5b:128 --humaneval-limit 20

(SmolLM2's 576 inputs are not a multiple of 128: 64 is its coarser group.)

Per model: the unquantized weights (the GGUF dequantized, `--quantization none`), then for each group size a
checkpoint written by `llmserve quantize --method int4` (round to nearest) and one by `--method awq`, both
from those same dequantized weights, each scored by `llmserve eval` on the directory (int4 path, int8
activations off so the weights alone are measured; bf16 or float32 as the host picks, the same for all).
Perplexity: gensim's Lee corpus, the first `--ppl-tokens` tokens, window 512 / stride 256. "gap closed":
how much of round to nearest's perplexity increase over the unquantized weights AWQ removes.
Writes benchmarks/results/awq_quality.{json,md}; the quantized directories stay in a cache folder
(`--work`), reused unless `--requantize`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLMSERVE = str(REPO / ".venv" / "bin" / "llmserve")
RESULTS = REPO / "benchmarks" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m:32,64", "qwen2.5-coder-0.5b:32,128"],
                    help="MODEL:GROUP,GROUP... (the group sizes to try on it)")
    ap.add_argument("--ppl-tokens", type=int, default=16384)
    ap.add_argument("--humaneval-limit", type=int, default=0, help="HumanEval problems (0: perplexity only)")
    ap.add_argument("--humaneval-models", nargs="*", default=None, help="models to run HumanEval on (default: all)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "llmserve" / "awq_quality")
    ap.add_argument("--requantize", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "awq_quality.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    rows = {(r["model"], r["method"], r["group_size"]): r for r in previous.get("rows", [])}
    for spec in args.models:
        model, _, sizes = spec.partition(":")
        group_sizes = [int(g) for g in (sizes or "32,128").split(",")]
        humaneval = args.humaneval_limit if args.humaneval_models is None or model in args.humaneval_models else 0
        variants = [("none", None)] + [(m, g) for g in group_sizes for m in ("int4", "awq")]
        for method, group in variants:
            done = rows.get((model, method, group), {})
            if done.get("ppl_limit") == args.ppl_tokens and done.get("humaneval_problems", 0) == humaneval:
                continue  # measured already, with these settings (a model listed twice: its baseline once)
            row = {"model": model, "method": method, "group_size": group, "ppl_limit": args.ppl_tokens}
            target = model
            if method != "none":
                target = str(args.work / f"{model}-{method}-g{group}")
                if args.requantize or not (Path(target) / "config.json").exists():
                    cmd = [LLMSERVE, "quantize", model, "--method", method, "--group-size", str(group), "--out", target]
                    row["quantize_s"], _ = _run(cmd)
                    row["quantize_command"] = _show(cmd)
                elif (model, method, group) in rows:
                    row.update({k: v for k, v in rows[(model, method, group)].items() if k.startswith("quantize")})
            scores = args.work / f"{model}-{method}-g{group}.json"
            row.update(_evaluate(target, method, args.ppl_tokens, humaneval, scores))
            rows[(model, method, group)] = row
            print(json.dumps(row), flush=True)
            _write(args.out, rows)


def _evaluate(target: str, method: str, ppl_tokens: int, humaneval: int, out: Path) -> dict:
    tasks = "perplexity" + (",humaneval" if humaneval else "")
    cmd = [LLMSERVE, "eval", target, "--tasks", tasks, "--ppl-tokens", str(ppl_tokens), "--out", str(out)]
    cmd += ["--quantization", "none"] if method == "none" else ["--no-int8-activations"]
    if humaneval:
        cmd += ["--limit", str(humaneval)]
    seconds, _ = _run(cmd)
    result = json.loads(out.read_text())
    ppl = result["tasks"]["perplexity"]
    row = {"perplexity": ppl["perplexity"], "ppl_tokens": ppl["tokens"], "eval_s": seconds, "eval_command": _show(cmd)}
    if "humaneval" in result["tasks"]:
        he = result["tasks"]["humaneval"]
        row.update(humaneval_pass_at_1=he["pass_at_1"], humaneval_passed=he["passed"],
                   humaneval_problems=he["problems"])
    return row


def _run(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    print("$", _show(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {_show(cmd)}")
    return round(time.perf_counter() - start, 1), done.stdout


def _show(cmd: list[str]) -> str:
    return " ".join(c.replace(LLMSERVE, "llmserve").replace(str(Path.home()), "~") for c in cmd)


def _write(out: Path, rows: dict) -> None:
    host = {"machine": platform.machine(), "cpus": os.cpu_count(), "processor": _cpu()}
    ordered = sorted(rows.values(), key=lambda r: (r["model"], r["group_size"] or 0, r["method"] != "none",
                                                   r["method"] != "int4"))
    out.write_text(json.dumps({"host": host, "rows": ordered}, indent=1) + "\n")
    out.with_suffix(".md").write_text(table(ordered, host) + "\n")


def table(rows: list[dict], host: dict) -> str:
    base = {r["model"]: r["perplexity"] for r in rows if r["method"] == "none"}
    rtn = {(r["model"], r["group_size"]): r["perplexity"] for r in rows if r["method"] == "int4"}
    lines = [f"Host: {host['processor']} ({host['cpus']} CPUs). Perplexity: Lee corpus, window 512 / stride 256.", "",
             "| model | weights | group | perplexity | vs unquantized | gap closed by AWQ | HumanEval pass@1 "
             "| quantize |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ppl, ref = r["perplexity"], base.get(r["model"])
        delta = f"{100 * (ppl / ref - 1):+.2f} %" if ref else "-"
        closed = "-"
        if r["method"] == "awq" and ref and (r["model"], r["group_size"]) in rtn:
            gap = rtn[r["model"], r["group_size"]] - ref
            closed = f"{100 * (rtn[r['model'], r['group_size']] - ppl) / gap:.0f} %" if gap > 0 else "-"
        he = (f"{r['humaneval_pass_at_1']:.3f} ({r['humaneval_passed']}/{r['humaneval_problems']})"
              if "humaneval_pass_at_1" in r else "-")
        name = {"none": "unquantized (GGUF dequantized)", "int4": "int4 round to nearest",
                "awq": "AWQ int4"}.get(r["method"], r["method"])
        lines.append(f"| {r['model']} | {name} | {r['group_size'] or '-'} | {ppl:.4f} | {delta} | {closed} | {he} | "
                     f"{str(r['quantize_s']) + ' s' if 'quantize_s' in r else '-'} |")
    return "\n".join(lines)


def _cpu() -> str:
    sys.path.insert(0, str(REPO))
    from llmserve.host import cpu_model

    return cpu_model()


if __name__ == "__main__":
    main()
