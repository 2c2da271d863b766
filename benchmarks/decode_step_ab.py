"""Offline decode-step time, attention backends A/B in one process.

    .venv/bin/python benchmarks/decode_step_ab.py                          # bf16, eager
    .venv/bin/python benchmarks/decode_step_ab.py --quantization int4      # int4 weights

One engine serves B requests (a shared 200-token prefix + a distinct 56-token tail, as the peer workload);
the decode attention is switched between the native kernel and the PyTorch path every 16 steps, six
times, and the median of each is reported: the host is noisy, so both sides see the same noise. (With
--compile the native side would run as one compiled graph and the torch side eagerly: the engine's
`decode_graph` is left out here so the comparison is the attention alone.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes (default: %(default)s)")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"])
    ap.add_argument("--steps", type=int, default=16, help="steps per timed stretch (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=6, help="stretches per backend (default: %(default)s)")
    args = ap.parse_args()
    print("loading the engine ...", flush=True)
    llm = LLM(kv_cache_memory_gb=1.0, max_num_seqs=64, quantization=args.quantization, attention_backend="native")
    engine = llm.engine
    tok = engine.tokenizer
    prefix = tok.encode("You are a helpful assistant. " * 40)[:200]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    print("| batch | torch path ms/step | native ms/step | torch / native |\n|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            tail = tok.encode(f" question {i} about the weather in town {i * 7}")[:56]
            engine.add_request(rid, prefix + tail, params)
        while any(engine.requests[r].num_computed_tokens < engine.requests[r].num_prompt_tokens for r in ids):
            engine.step()
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for native in (False, True):
                engine.runner.native_attention = native
                engine.step()  # the first step after a switch builds the other metadata kind
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[native].append((time.perf_counter() - start) / args.steps * 1e3)
        for rid in ids:
            engine.abort_request(rid)
        torch_ms, native_ms = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {batch} | {torch_ms:.1f} | {native_ms:.1f} | {torch_ms / native_ms:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
