"""Greedy tokens of a model as served by default (`LLM(model)`, its draft included), as JSON: run once per build
and compare the files (session 53: the start-up changes must leave every token as it was).

Usage: greedy_ab.py MODEL OUT.json   (run from the checkout to measure; PYTHONPATH picks the build)
"""

from __future__ import annotations

import json
import sys

from llmserve import LLM, SamplingParams

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a paged KV cache is in two sentences.",
           "def quicksort(xs):"]


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    llm = LLM(model)
    greedy = SamplingParams(temperature=0, max_tokens=64)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    tokens = [o.outputs[0].token_ids for o in llm.chat(chats, greedy, use_tqdm=False)]
    tokens += [o.outputs[0].token_ids for o in llm.generate(PROMPTS[2:], greedy, use_tqdm=False)]
    with open(out, "w") as f:
        json.dump({"model": model, "tokens": [list(t) for t in tokens]}, f)
    print(model, [len(t) for t in tokens])


if __name__ == "__main__":
    main()
