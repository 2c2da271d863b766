"""Session 38: Qwen2.5-Coder-1.5B's default, its 14 mixed q/k/v as `StackedLinear`s (Q4_K q/k int4 + Q6_K v 6-bit)
against the same engine with those q/k/v kept as one int8-per-row weight (the behaviour before: `_format_runs`
made to return one run while that engine loads), decode steps alternated in one process (benchmarks/
decode_step_configs.py's timing).

    .venv/bin/python benchmarks/results/zen5/qwen1.5b-stacked/stacked_ab.py --batches 1,8 --repeats 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from decode_step_configs import time_engines  # noqa: E402

from llmserve import LLM  # noqa: E402
from llmserve.quantization import weight_only  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    common = dict(model="qwen2.5-coder-1.5b", kv_cache_memory_gb=1.0, max_num_seqs=64)
    stacked = LLM(**common).engine
    split = weight_only._format_runs
    weight_only._format_runs = lambda sources, rows, format_of: [(sources, slice(0, sum(rows)))]
    try:
        fused = LLM(**common).engine
    finally:
        weight_only._format_runs = split
    assert type(stacked.runner.model.layers[0].self_attn.qkv_proj).__name__ == "StackedLinear"
    assert type(fused.runner.model.layers[0].self_attn.qkv_proj).__name__ == "WeightOnlyLinear"
    time_engines({"stacked": stacked, "one int8 weight": fused}, [int(b) for b in args.batches.split(",")],
                 args.steps, args.repeats)


if __name__ == "__main__":
    main()
