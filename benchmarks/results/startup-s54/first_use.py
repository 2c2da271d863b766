"""A fresh default engine's first batch: 32 requests of ~500 prompt tokens and 128 output tokens, then another such
batch of other prompts: seconds each, and the resident memory after start and after each batch. Run from the checkout
to measure (PYTHONPATH picks the build); compares a cache zeroed at start with one the kernel zeroes on first touch
(session 54)."""

from __future__ import annotations

import random
import time

from llmserve import LLM, SamplingParams


def resident_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e9


def batch(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(500)] for _ in range(32)]


start = time.perf_counter()
llm = LLM()
line = [f"LLM() {time.perf_counter() - start:.1f} s, resident {resident_gb():.2f} GB"]
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for seed in (1, 2):
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in batch(seed)], params, use_tqdm=False)
    line.append(f"batch {seed} {time.perf_counter() - start:.2f} s, resident {resident_gb():.2f} GB")
print("; ".join(line), flush=True)
