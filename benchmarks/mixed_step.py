"""A busy server's eager steps, with the layers' elementwise work on the fused kernels and on PyTorch's ops.

    .venv/bin/python benchmarks/mixed_step.py [--decodes 31] [--repeats 5]

At c=32 a step that also prefills a new request comes every ~4 steps and runs eagerly (the compiled graph
covers decode-only steps). This loads one engine (int4 weights, int8 activations, bfloat16) and keeps
`--decodes` requests decoding (a shared 205-token prefix + a distinct tail, as the peer workload); a mixed
step adds one more such request (its 192 cached prefix tokens skipped, the rest prefilled) beside the
decodes and aborts it after the step. The same engine alternates between the two settings of
`native_elementwise` on its layers, five stretches each, and the medians are reported: the host is noisy,
and both settings see the same noise and the same weights.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.models.llama import use_native_elementwise  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=31, help="requests decoding beside it (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timed stretches per setting (default: %(default)s)")
    args = ap.parse_args()
    engine = LLM(kv_cache_memory_gb=1.0, max_num_seqs=64, quantization="int4", int8_activations=True,
                 speculative_config="off").engine
    tok = engine.tokenizer
    prefix = tok.encode("You are a helpful assistant. " * 40)[:205]
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    ids = itertools.count()

    def add() -> str:
        n = next(ids)
        tail = tok.encode(f" Question number {n}: tell me about topic {n * 7} in detail please." * 4)[:51]
        engine.add_request(f"r{n}", prefix + tail, params)
        return f"r{n}"

    for _ in range(args.decodes):
        add()
    for _ in range(40):  # every request past its prompt
        engine.step()

    def mixed() -> None:
        request_id = add()
        engine.step()
        engine.abort_request(request_id)

    def median_ms(step, n: int) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for native in (False, True):
            use_native_elementwise(engine.runner.model, native)
            results[native].append((median_ms(mixed, 5), median_ms(engine.step, 5)))
    print(f"| layers' elementwise ops | mixed step ms ({args.decodes} decodes + a prompt) | "
          f"eager decode step ms (batch {args.decodes}) |")
    print("|---|---:|---:|")
    for native in (False, True):
        mixed_ms = statistics.median(r[0] for r in results[native])
        decode_ms = statistics.median(r[1] for r in results[native])
        print(f"| {'fused kernels' if native else 'PyTorch ops'} | {mixed_ms:.1f} | {decode_ms:.1f} |")


if __name__ == "__main__":
    main()
