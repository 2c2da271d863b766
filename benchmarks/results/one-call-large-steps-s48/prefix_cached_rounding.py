"""How far a prefix-cached second run of the same prompts lands from the first (greedy, logprobs).

    .venv/bin/python benchmarks/results/one-call-large-steps-s48/prefix_cached_rounding.py '{"dtype": "float32"}'

The argument: LLM keyword arguments as a Python dict literal. Prints how many requests changed a token and the
largest logprob difference over the tokens both runs ranked.
"""

from __future__ import annotations

import ast
import sys

from llmserve import LLM, SamplingParams


def main() -> None:
    options = ast.literal_eval(sys.argv[1]) if len(sys.argv) > 1 else {}
    llm = LLM(kv_cache_memory_gb=0.25, max_model_len=1024, max_num_seqs=40, speculative_config="off", **options)
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(20 + i)] for i in range(33)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    first = llm.generate(prompts, params, use_tqdm=False)
    cached = llm.generate(prompts, params, use_tqdm=False)
    changed, worst = 0, 0.0
    for a, b in zip(first, cached, strict=True):
        changed += a.outputs[0].token_ids != b.outputs[0].token_ids
        for ranked_a, ranked_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token in ranked_a.keys() & ranked_b.keys():
                worst = max(worst, abs(ranked_a[token].logprob - ranked_b[token].logprob))
    print(options, "requests with a different token:", changed, "worst logprob difference:", round(worst, 4))


if __name__ == "__main__":
    main()
