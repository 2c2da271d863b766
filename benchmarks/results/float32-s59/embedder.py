"""The gateway's MiniLM embedder with its linears on MKL's `F.linear` (before) and on oneDNN's packed product (session
59's default): ms an `embed` call, the two alternated in one process, and the lowest cosine between their rows.

    .venv/bin/python benchmarks/results/float32-s59/embedder.py
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

import torch

import llmserve.layers.linear as linear
from llmserve.gateway.embedder import Embedder

TEXTS = {
    "1 short": ["How do I reverse a list in Python?"],
    "1 long": ["Explain, with an example, how the attention mechanism of a transformer decides which earlier tokens "
               "matter for the next one, and why a KV cache makes decoding cheaper. " * 3],
    "8 short": [f"What is the capital of country number {i}?" for i in range(8)],
}


def main(rounds: int = 30) -> None:
    torch.set_num_threads(2)
    packed, plain = Embedder(), Embedder()
    packed.embed(["warm"])
    with mock.patch.object(linear, "prepack_linears", lambda model, release_plain=False: 0):
        plain.embed(["warm"])
    for name, batch in TEXTS.items():
        cosine = (plain.embed(batch) * packed.embed(batch)).sum(1).min()
        times: dict[str, list[float]] = {"MKL": [], "oneDNN packed": []}
        for r in range(rounds):
            order = [("MKL", plain), ("oneDNN packed", packed)]
            for label, embedder in order if r % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                embedder.embed(batch)
                times[label].append((time.perf_counter() - start) * 1e3)
        cells = "  ".join(f"{label} {statistics.median(ms):.2f} ms" for label, ms in times.items())
        print(f"{name}: {cells}  lowest cosine {cosine:.7f}", flush=True)


if __name__ == "__main__":
    main()
