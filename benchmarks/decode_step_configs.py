"""Offline decode-step time of engine configurations, A/B(/C...) in one process.

    .venv/bin/python benchmarks/decode_step_configs.py --config "default=" --config "no-quant=quantization=none"
    .venv/bin/python benchmarks/decode_step_configs.py --config "4k=huge_pages=false" --config "huge=huge_pages=true" \
        --batches 1,8,32,1,8 --repeats 8
    .venv/bin/python benchmarks/decode_step_configs.py --config "base=model=qwen2.5-coder-1.5b,q8_activations=false" \
        --config "q8=model=qwen2.5-coder-1.5b" --batches 1,8,16,32 --repeats 3 --steps 8
    .venv/bin/python benchmarks/decode_step_configs.py --config "default=" --batches 1,2 --steps 2 --repeats 1  # smoke

Why: a choice the build plan makes (quantization, Q8_0 inputs, huge pages, the one-call stack, a kernel) is decided
on the decode step it gives; in one process both configurations see the same weights and the same noise of a
shared host. docs/performance.md, "The default configuration" and "Large steps", cites these tables.

Each configuration is an `LLM(...)` of its own (keyword=value pairs; true/false/none and numbers are parsed), all
loaded in this process. Per batch size, each engine serves the same B requests (a shared 200-token prefix + a
distinct 56-token tail, as the peer workload), then timed stretches of decode steps alternate between the engines
(`--repeats` each), and the median ms a step is reported. The first configuration is the baseline of the ratios.
Speculation is off unless a configuration asks for it: one token a step per request is what is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve import LLM, SamplingParams  # noqa: E402


def parse_config(text: str) -> tuple[str, dict]:
    name, _, pairs = text.partition("=")
    kwargs: dict = {}
    for pair in filter(None, pairs.split(",")):
        key, _, raw = pair.partition("=")
        value: object = {"true": True, "false": False, "none": None}.get(raw.lower(), raw)
        if isinstance(value, str):
            try:
                value = float(raw) if "." in raw else int(raw)
            except ValueError:
                pass
        kwargs[key.strip()] = value
    return name, kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", required=True, metavar="NAME=KEY=VALUE,...",
                    help="an engine configuration (LLM keyword arguments), repeatable; the first is the baseline")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=16, help="steps per timed stretch (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=6, help="stretches per configuration (default: %(default)s)")
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.config]
    engines = {}
    for name, kwargs in configs:
        print(f"loading {name}: {kwargs} ...", flush=True)
        # a step of one token per request: no proposals (unless a configuration asks for them)
        engines[name] = LLM(kv_cache_memory_gb=1.0, max_num_seqs=64, **{"speculative_config": "off", **kwargs}).engine
    time_engines(engines, [int(b) for b in args.batches.split(",")], args.steps, args.repeats)


def time_engines(engines: dict, batches: list[int], steps: int, repeats: int) -> None:
    """The table: per batch size, each engine's median ms a decode step, stretches alternated between them."""
    tok = next(iter(engines.values())).tokenizer
    prefix = tok.encode("You are a helpful assistant. " * 40)[:200]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    names = list(engines)
    print("| batch | " + " | ".join(f"{n} ms/step" for n in names) + " | "
          + " | ".join(f"{names[0]} / {n}" for n in names[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(names) - 1))
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for engine in engines.values():
            for i, rid in enumerate(ids):
                tail = tok.encode(f" question {i} about the weather in town {i * 7}")[:56]
                engine.add_request(rid, prefix + tail, params)
            while any(engine.requests[r].num_computed_tokens < engine.requests[r].num_prompt_tokens for r in ids):
                engine.step()
            engine.step()
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[name].append((time.perf_counter() - start) / steps * 1e3)
        for engine in engines.values():
            for rid in ids:
                engine.abort_request(rid)
        ms = [statistics.median(times[n]) for n in names]
        print(f"| {batch} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
              + " | ".join(f"{ms[0] / m:.2f}x" for m in ms[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
