"""What the parallel layouts' tests share: their prompts and transformers' greedy tokens for them (on the `tiny` model
each test module defines), and the check each layout owes when a rank dies: the engine turns unhealthy, its next
step fails fast with the reason, and shutting it down leaves no worker behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.model_runner import RunnerStoppedError
from llmserve.evaluate.reference import reference_greedy, reference_model
from llmserve.loader import load_checkpoint

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village at the edge of a forest,",
           " ".join(f"Item {i}: the quick brown fox." for i in range(20))]


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    tokenizer = load_checkpoint(tiny).tokenizer
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(tiny, prompts) -> list[list[int]]:
    """transformers' 16 greedy tokens for each prompt, all different (a mixed-up batch would show)."""
    reference = reference_model(tiny, torch.float32)
    tokens = [reference_greedy(reference, ids, 16) for ids in prompts]
    assert len({tuple(t) for t in tokens}) == len(tokens)
    return tokens


def assert_a_killed_worker_stops_the_engine(llm: LLM, worker: mp.Process, prompt: list[int], match: str) -> None:
    workers = llm.engine.runner._workers
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    assert not llm.engine.healthy
    start = time.monotonic()
    with pytest.raises(RunnerStoppedError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 20
    llm.shutdown()
    assert not any(w.is_alive() for w in workers)
