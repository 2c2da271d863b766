"""Experiment (session 53, dropped): the first X MB of the weight arena prefetched temporally (kept in L3), the
rest non-temporally, one request's decode steps timed, the variants alternated in one process.

Needs `resident_l3.patch` applied to the kernels (LLMSERVE_EXP_LO/HI name the cached address range).
Usage: resident_l3.py MODEL MBS ROUNDS, e.g. resident_l3.py smollm2-135m 0,8,16,24 6
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bandwidth_ceiling import read_rate, step_weight_bytes  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.quantization.weight_arena import streamed_weights  # noqa: E402


def main() -> None:
    model_name, mbs, rounds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    torch.set_num_threads(2)
    engine = LLM(model_name, speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096).engine
    model = engine.runner.model
    weights = step_weight_bytes(model)
    lo = min(getattr(m, n).data_ptr() for m, n in streamed_weights(model))
    prompt = torch.randint(3, engine.model_config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    engine.add_request("probe", prompt.tolist(), SamplingParams(temperature=0, max_tokens=3800, ignore_eos=True))
    while engine.requests["probe"].num_computed_tokens < len(prompt):
        engine.step()
    buffer = torch.ones(2**28, dtype=torch.float32)
    steps = {mb: [] for mb in mbs}
    for r in range(rounds):
        for mb in mbs if r % 2 == 0 else mbs[::-1]:
            os.environ["LLMSERVE_EXP_LO"], os.environ["LLMSERVE_EXP_HI"] = str(lo), str(lo + mb * 2**20)
            rate = read_rate(buffer)
            for _ in range(6):
                engine.step()
            start = time.perf_counter()
            for _ in range(48):
                engine.step()
            step = (time.perf_counter() - start) / 48 * 1e3
            steps[mb].append(step)
            print(f"round {r} MB {mb:3d} rate {rate:5.1f} step {step:.3f} ms share {weights / rate / 1e6 / step:.0%}")
    for mb in mbs:
        print(mb, "median step ms", round(statistics.median(steps[mb]), 3), [round(x, 2) for x in steps[mb]])


if __name__ == "__main__":
    main()
