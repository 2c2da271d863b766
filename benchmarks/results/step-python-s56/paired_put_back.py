"""What the tensors a batch-1 step no longer makes cost it, on the caches a step leaves: stretches of the step as
built (A) and with that work put back (B), alternated in one process, so that the host's state moves under both
alike. Put back: the step's block table as a long tensor, its decode rows sliced and converted to the kernel's int32
(the table is now made as int32 from the lists), the K/V slots' flatten, and a greedy step's temperature tensor.

    python benchmarks/results/step-python-s56/paired_put_back.py [rounds]
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "step-rest-s55"))
from steady import alternate, decoding_engine  # noqa: E402  (session 55's probe engine)

from llmserve.engine import model_runner

llm, engine = decoding_engine(3800)
runner = engine.runner
built_metadata, built_sampling = model_runner.attention_metadata, runner._sampling_metadata


def metadata_put_back(backend, tables, *args):
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    block_table[: len(tables)].to(dtype=torch.int32)
    meta = built_metadata(backend, tables, *args)
    meta.write_slots.flatten()
    return meta


def sampling_put_back(rows, vocab_size):
    torch.tensor([0.0 if row.state.params.greedy else row.state.params.temperature for row in rows],
                 dtype=torch.float32)
    return built_sampling(rows, vocab_size)


spans = {"A": 0.0, "B": 0.0}  # seconds inside the two calls, per variant: the span the change touches


def spanned(call, variant):
    def wrapper(*args):
        start = time.perf_counter()
        out = call(*args)
        spans[variant] += time.perf_counter() - start
        return out
    return wrapper


def use(variant: str) -> None:
    model_runner.attention_metadata = spanned(built_metadata if variant == "A" else metadata_put_back, variant)
    runner._sampling_metadata = spanned(built_sampling if variant == "A" else sampling_put_back, variant)


rounds, steps = int(sys.argv[1]) if len(sys.argv) > 1 else 38, 48
print(f"{rounds} rounds of {steps} steps: {alternate(engine, use, rounds, steps)}; inside the two calls: A "
      f"{spans['A'] / rounds / steps * 1e6:.0f} us a step, B {spans['B'] / rounds / steps * 1e6:.0f} us")
