#!/usr/bin/env python3
"""One process against a parallel group on the same cores: tensor-parallel ranks and pipeline stages.

    .venv/bin/python benchmarks/parallel_ranks.py                              # qwen2.5-coder-0.5b, ~6 min on 2 cores
    .venv/bin/python benchmarks/parallel_ranks.py --model smollm2-135m --layouts 1x1,1x2
    .venv/bin/python benchmarks/parallel_ranks.py --output-len 4 --prefill-len 64 --rounds 1 --out /tmp/ranks  # smoke

Why: on one CPU socket the ranks share the cores and the memory bandwidth one process already uses, so neither
layout can beat one process here; what they cost, and where, says when each pays elsewhere. Tensor parallelism
pays its all-reduces (two a layer) on every step; a pipeline pays the stages' sequence: a step of one request runs
its stages one after the other, a step of several is cut into micro-batches that overlap across stages, each
stage then reading its weights once per micro-batch.

Per layout (tensor-parallel ranks x pipeline stages, the threads split evenly among the ranks), with the build plan's
defaults otherwise: decode tokens/s of 1 and of 8 concurrent requests (greedy, `--output-len` tokens after a short
prompt, the prompt's time left out), and the seconds of one `--prefill-len`-token prompt. Layouts are interleaved over
`--rounds` (each built afresh), so a noisy neighbour slows them alike; the ratios to 1x1 are what to read.
Writes <out>.json and <out>.md (default benchmarks/results/parallel-ranks/<host>-<model>).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.evaluate.datasets import perplexity_text  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_vs_peers import host_tag  # noqa: E402


def measure(model: str, tp: int, pp: int, output_len: int, prefill_len: int) -> dict:
    """One layout's decode rates (1 and 8 requests) and one prompt's prefill time, on an engine built for it."""
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        text = llm.engine.processor.encode(perplexity_text())
        rss = [psutil.Process().memory_info().rss] + [psutil.Process(w.pid).memory_info().rss
                                                      for w in getattr(llm.engine.runner, "_workers", [])]
        result = {"tp": tp, "pp": pp, "rss_gib": [round(r / 2**30, 2) for r in rss]}
        for batch in (1, 8):
            prompts = [text[i * 40:i * 40 + 32] for i in range(batch)]
            first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            full = SamplingParams(temperature=0, max_tokens=output_len + 1, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            prompt_s = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate(prompts, full, use_tqdm=False)  # the prompts again (prefix caching), then the decodes
            result[f"decode_b{batch}_tok_s"] = batch * output_len / (time.perf_counter() - start - prompt_s)
        prompt = text[1000:1000 + prefill_len]
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        result["prefill_s"] = time.perf_counter() - start
        return result
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--layouts", default="1x1,2x1,1x2", help="tensor-parallel ranks x pipeline stages, each")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    layouts = [tuple(int(n) for n in layout.split("x")) for layout in args.layouts.split(",")]
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for tp, pp in layouts:
            print(f"round {round_ + 1}/{args.rounds}: {tp} tensor-parallel x {pp} pipeline ...", flush=True)
            run = measure(args.model, tp, pp, args.output_len, args.prefill_len)
            print("  ", {k: round(v, 2) if isinstance(v, float) else v for k, v in run.items()}, flush=True)
            runs.setdefault(f"{tp}x{pp}", []).append(run)
    out = args.out or REPO / "benchmarks" / "results" / "parallel-ranks" / f"{host_tag()}-{args.model}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.parent.joinpath(out.name + ".json").write_text(json.dumps({"model": args.model, "runs": runs}, indent=1))
    keys = ("decode_b1_tok_s", "decode_b8_tok_s", "prefill_s")
    medians = {layout: {k: statistics.median(r[k] for r in rs) for k in keys} for layout, rs in runs.items()}
    base = medians.get("1x1")
    lines = [f"# Parallel ranks on one host, {args.model}, {psutil.cpu_count()} CPUs", "",
             f"Medians of {args.rounds} interleaved rounds; decode after a 32-token prompt, {args.output_len} tokens; "
             f"prefill: one {args.prefill_len}-token prompt. (x): against one process.", "",
             "| tensor-parallel x stages | decode b1 tok/s | decode b8 tok/s | prefill s | RSS GiB per rank |",
             "|---|---:|---:|---:|---|"]
    for layout, m in medians.items():
        def ratio(key: str, inverse: bool = False, m: dict = m, layout: str = layout) -> str:
            """Against one process, as a speed (a time inverted)."""
            if not base or layout == "1x1":
                return ""
            return f" ({(base[key] / m[key] if inverse else m[key] / base[key]):.2f}x)"

        lines.append(f"| {layout} | {m['decode_b1_tok_s']:.1f}{ratio('decode_b1_tok_s')} | "
                     f"{m['decode_b8_tok_s']:.1f}{ratio('decode_b8_tok_s')} | "
                     f"{m['prefill_s']:.2f}{ratio('prefill_s', True)} | "
                     f"{', '.join(str(r) for r in runs[layout][-1]['rss_gib'])} |")
    out.parent.joinpath(out.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
