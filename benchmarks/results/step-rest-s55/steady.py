"""The probes' engine: the default model (SmolLM2) as served, one request decoding after a 256-token prompt."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine


def decoding_engine(max_tokens: int = 3500, prompt_tokens: int = 256) -> tuple[LLM, LLMEngine]:
    """Two threads, speculation off; returns once the prompt is computed and 16 tokens decoded."""
    torch.set_num_threads(2)
    llm = LLM(speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096)
    engine = llm.engine
    prompt = torch.randint(3, engine.model_config.vocab_size, (prompt_tokens,),
                           generator=torch.Generator().manual_seed(0))
    engine.add_request("probe", prompt.tolist(), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.requests["probe"].num_computed_tokens < len(prompt):
        engine.step()
    for _ in range(16):
        engine.step()
    return llm, engine


def alternate(engine: LLMEngine, use: Callable[[str], None], rounds: int, steps: int = 48) -> str:
    """Stretches of `steps` steps under variant "A" and "B" (`use` switches to one), their order swapped each round,
    so that the host's state moves under both alike: a line of the medians, and B - A's median, mean and quartiles."""
    diffs, times_a, times_b = [], [], []
    for r in range(rounds):
        times = {}
        for variant in ("A", "B") if r % 2 == 0 else ("B", "A"):
            use(variant)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[variant] = (time.perf_counter() - start) / steps * 1e3
        diffs.append(times["B"] - times["A"])
        times_a.append(times["A"])
        times_b.append(times["B"])
    return (f"A {statistics.median(times_a):.3f} ms, B {statistics.median(times_b):.3f} ms, B-A median "
            f"{statistics.median(diffs) * 1e3:.0f} us, mean {statistics.mean(diffs) * 1e3:.0f} us, quartiles "
            f"{[round(q * 1e3) for q in statistics.quantiles(diffs, n=4)]}")
