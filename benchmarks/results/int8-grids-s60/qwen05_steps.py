"""Qwen2.5-Coder-0.5B (Q4_K_M: mostly Q5_0, some Q8_0, ffn_down Q4_K/Q6_K), session 60: decode steps as the
default ran them before (weights as loaded: the file's values dequantized to bf16, dense products) and as it runs
them now (int4 + int8 on the file's own grids: Q5_0/Q8_0 in the int8 kernel's grouped layout). Both engines in one
process, speculation off (one token a step per request), stretches alternated: tok/s at a batch of 1 and 8, and
the greedy tokens each engine gives the same prompts.

    .venv/bin/python benchmarks/results/int8-grids-s60/qwen05_steps.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from llmserve import LLM, SamplingParams

PROMPTS = ["def is_prime(n):", "The three laws of thermodynamics are", "# Sort a list of tuples by their second item\n",
           "class Stack:\n", "import numpy as np\n\ndef softmax(x):", "SELECT name FROM users WHERE",
           "Write a haiku about the sea.", "fn main() {\n"]


def engine(quantization: str) -> LLM:
    return LLM("qwen2.5-coder-0.5b", quantization=quantization, speculative_config="off", kv_cache_memory_gb=0.5,
               max_model_len=2048)


def tok_s(llm: LLM, batch: int, tokens: int = 48) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [llm.engine.processor.encode(p) for p in PROMPTS[:batch]]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # prefill cached
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - start)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    torch.manual_seed(0)
    engines = {"as loaded (before)": engine("none"), "int4+int8 grids (now)": engine("auto")}
    for name, llm in engines.items():
        print(name, "|", llm.engine.plan.weights, "|", llm.engine.plan.reasons.get("weights", "as asked"))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {name: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            for name, llm in engines.items()}
    a, b = outs.values()
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first = [next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), 32)
             for x, y in zip(a, b, strict=True)]
    print(f"greedy, 8 prompts x 32 tokens: {same} of 8 identical; first differing token per prompt: {first}")
    for batch in (1, 8):
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(rounds):
            for name in engines if r % 2 == 0 else list(engines)[::-1]:
                rates[name].append(tok_s(engines[name], batch))
        line = ", ".join(f"{name} {statistics.median(v):.1f} tok/s {[round(x, 1) for x in v]}"
                         for name, v in rates.items())
        names = list(engines)
        ratio = statistics.median(rates[names[1]]) / statistics.median(rates[names[0]])
        print(f"batch {batch}: {line}; now / before {ratio:.2f}x")


if __name__ == "__main__":
    main()
