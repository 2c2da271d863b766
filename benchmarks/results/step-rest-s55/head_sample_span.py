"""A greedy batch-1 step's span from the head to the sampled token (compute_logits to the end of sample), with the
head's output as it is (bfloat16) and copied to float32 first, stretches alternated in one process: the copy's cost
on the caches a step leaves, without the rest of the step's noise.

    python benchmarks/results/step-rest-s55/head_sample_span.py
"""

from __future__ import annotations

import statistics
import time

from steady import decoding_engine

from llmserve.engine import model_runner

llm, engine = decoding_engine(3800)
model = engine.runner.model
plain_logits, plain_sample = model.compute_logits, model_runner.sample
clock = {"start": 0.0, "seconds": 0.0, "float32": False}


def compute_logits(hidden, as_float=True):
    clock["start"] = time.perf_counter()
    return plain_logits(hidden, as_float=as_float or clock["float32"])


def sample(*args, **kwargs):
    out = plain_sample(*args, **kwargs)
    clock["seconds"] += time.perf_counter() - clock["start"]
    return out


model.compute_logits = compute_logits
model_runner.sample = sample
steps, spans = 48, {False: [], True: []}
for r in range(36):
    for float32 in (False, True) if r % 2 == 0 else (True, False):
        clock["float32"], clock["seconds"] = float32, 0.0
        for _ in range(steps):
            engine.step()
        spans[float32].append(clock["seconds"] / steps * 1e6)
diffs = [b - a for a, b in zip(spans[False], spans[True], strict=True)]
print(f"head to sampled token, us a step: bfloat16 {statistics.median(spans[False]):.0f}, float32 "
      f"{statistics.median(spans[True]):.0f}, float32 - bfloat16 median {statistics.median(diffs):.0f}, quartiles "
      f"{[round(q) for q in statistics.quantiles(diffs, n=4)]}")
