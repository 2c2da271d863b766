"""Where a batch-1 step's time goes outside the decoder stack: wall time of the engine's calls, wrapped.

    python benchmarks/results/step-rest-s55/step_split.py [stretches]

Each stretch is 200 steps of the default model (SmolLM2) decoding one request after a 256-token prompt; a line
per stretch with the ms a step of each call (indented names are inside the one above them).
"""

from __future__ import annotations

import collections
import sys
import time

from steady import decoding_engine

from llmserve.engine import model_runner

llm, engine = decoding_engine()
runner, model = engine.runner, engine.runner.model
seconds: collections.Counter[str] = collections.Counter()


def timed(call, label: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = call(*args, **kwargs)
        seconds[label] += time.perf_counter() - start
        return out
    return wrapper


class TimedStack:
    def __init__(self, stack) -> None:
        self.run = timed(stack.run, "stack.run")


for owner, name, label in [(engine.scheduler, "schedule", "schedule"), (runner, "execute", "execute"),
                           (model, "forward_fused", "  forward_fused"), (model, "compute_logits", "  compute_logits"),
                           (model.lm_head, "forward", "    lm_head"),
                           (runner, "_sampling_metadata", "  sampling_metadata"),
                           (engine.scheduler, "update_from_output", "update_from_output"),
                           (engine, "_update_output", "_update_output")]:
    setattr(owner, name, timed(getattr(owner, name), label))
model_runner.attention_metadata = timed(model_runner.attention_metadata, "  attention_metadata")
model_runner.sample = timed(model_runner.sample, "  sample")
runner.fused_stack = TimedStack(runner.fused_stack)

steps = 200
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    seconds.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step = (time.perf_counter() - start) / steps
    print(f"step {step * 1e3:.3f} ms: " + ", ".join(f"{k.strip()} {v / steps * 1e3:.3f}" for k, v in seconds.items()),
          flush=True)
