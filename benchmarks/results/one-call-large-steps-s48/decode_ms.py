"""Median ms per decode step of the engine this checkout (or PYTHONPATH) imports, at fixed batch sizes.

    PYTHONPATH=/tmp/base .venv/bin/python benchmarks/results/one-call-large-steps-s48/decode_ms.py default base
    .venv/bin/python benchmarks/results/one-call-large-steps-s48/decode_ms.py compile new --batches 32,24

One process per build, alternated by hand (`alternate.log`): the host moves between states every few minutes.
Session 49 added `--model`, `--dtype` and `--int8-activations` (the dense large steps, `dense-large-steps-s49/`).
Each batch: B requests of 200 prompt tokens, 30 steps to settle, then six stretches of `--steps` decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["default", "compile"])
    ap.add_argument("label")
    ap.add_argument("--batches", default="32,24")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--int8-activations", choices=["auto", "on", "off"], default="auto")
    args = ap.parse_args()
    int8 = {"auto": None, "on": True, "off": False}[args.int8_activations]
    engine = LLM(args.model, dtype=args.dtype, int8_activations=int8, kv_cache_memory_gb=1.0, max_num_seqs=64,
                 speculative_config="off", compile=args.mode == "compile").engine
    medians = {}
    for batch in (int(b) for b in args.batches.split(",")):
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        ids = [f"r{batch}-{i}" for i in range(batch)]
        for i, request_id in enumerate(ids):
            engine.add_request(request_id, [1 + (i * 7 + j) % 1000 for j in range(200)], params)
        for _ in range(30):
            engine.step()
        times = []
        for _ in range(6):
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times.append((time.perf_counter() - start) / args.steps * 1e3)
        medians[batch] = statistics.median(times)
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    print(args.label, args.mode, " ".join(f"b{b}={ms:.2f}ms" for b, ms in medians.items()), flush=True)


if __name__ == "__main__":
    main()
