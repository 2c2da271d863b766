"""Does the decode graph still need Inductor's freezing once its products are our own ops? `LLM(float32, int4,
int8_activations, compile=True)` built with freezing as the engine does it (`freeze`) or patched off (`nofreeze`):
start-up, and greedy tokens a second at batch 1 and 24 (the last column hashes the tokens).

    python benchmarks/results/step-python-s56/freezing_int8.py freeze|nofreeze
"""

from __future__ import annotations

import sys
import time

import torch._inductor.config as inductor_config

import llmserve.engine.decode_graph as decode_graph
from llmserve import LLM, SamplingParams

freeze = sys.argv[1] == "freeze"
patch = inductor_config.patch


def freezing_as_asked(*args, **kwargs):
    if "freezing" in kwargs:
        kwargs["freezing"] = freeze
    return patch(*args, **kwargs)


decode_graph.inductor_config = type("Config", (), {"patch": staticmethod(freezing_as_asked)})
start = time.perf_counter()
llm = LLM(dtype="float32", quantization="int4", int8_activations=True, compile=True, kv_cache_memory_gb=0.25,
          max_model_len=2048, speculative_config="off")
print("start", round(time.perf_counter() - start, 1))
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for n in (1, 24, 1, 24):
    prompts = [[(7 * i + j) % 40000 + 10 for j in range(40)] for i in range(n)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) % 10**8
    print(sys.argv[1], "batch", n, f"{n * 64 / seconds:.1f} tok/s", tokens)
