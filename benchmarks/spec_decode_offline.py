#!/usr/bin/env python3
"""Speculative decoding off vs on in one process, no server: the same `llmserve bench` workload's prompts all
added at once to an `LLM`'s engine, stepped to the end, alternated between two engines for several rounds.

    .venv/bin/python benchmarks/spec_decode_offline.py --workload code-edit --concurrency 32 --rounds 2

What it separates: a served on/off ratio (benchmarks/spec_decode.py) holds the engine's decisions and the serving
path together; this one holds the engine alone. Prints output tok/s per round, steps, and the speculator's timed
step cost per size.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.bench.tokens import approximate_counter  # noqa: E402
from llmserve.bench.workload import WorkloadConfig, make_workload  # noqa: E402


def run_round(llm: LLM, prompts: list[str], params: SamplingParams, tag: str, stagger: int) -> tuple[float, int]:
    """Output tokens per second and steps: the prompts added at once, or one every `stagger` steps (as a
    server's arrive, so that prompt chunks share steps with decodes)."""
    engine = llm.engine
    pending = list(enumerate(prompts))
    start, steps, tokens = time.perf_counter(), 0, 0
    while pending or engine.has_unfinished_requests():
        while pending and (not stagger or steps % stagger == 0):
            i, prompt = pending.pop(0)
            engine.add_request(f"{tag}-{i}", prompt, params)
            if stagger:
                break
        tokens += sum(len(out.outputs[0].token_ids) for out in engine.step())
        steps += 1
    return tokens / (time.perf_counter() - start), steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="code-edit")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculative-config", default='{"method": "ngram"}')
    ap.add_argument("--stagger", type=int, default=0, help="add one prompt every N steps (default: all at once)")
    args = ap.parse_args()
    workload = make_workload(WorkloadConfig(name=args.workload, output_len=args.output_len), approximate_counter())
    requests = [workload.request(f"s{i}", 0) for i in range(args.concurrency)]
    engines = {"off": LLM(args.model, max_num_seqs=args.concurrency, speculative_config="off"),
               "on": LLM(args.model, max_num_seqs=args.concurrency, speculative_config=args.speculative_config)}
    prompts = [engines["off"].engine.apply_chat_template(r.messages) for r in requests]
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    for round_ in range(args.rounds):
        rates = {}
        for name in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            rates[name], steps = run_round(engines[name], prompts, params, f"r{round_}", args.stagger)
            print(f"round {round_ + 1} {name}: {rates[name]:.1f} out tok/s, {steps} steps", flush=True)
        print(f"round {round_ + 1}: on / off {rates['on'] / rates['off']:.2f}x", flush=True)
    speculator = engines["on"].engine.speculator
    print("on: timed decode-only step ms by token count:",
          {n: round(s * 1e3, 1) for n, s in sorted(speculator.cost._mean.items())})
    print("on:", speculator.stats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
