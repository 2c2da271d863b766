"""`--compile`'s warm-up, each shape class timed: `LLM(compile=True)` in float32, dense (`native`, as
tests/engine/test_compile.py builds it) or int4 weights with int8 activations (`int8`, as
tests/quantization/test_int8_activations.py does); then Dynamo's own split of the compile time (a
`compile_attempt_1` line is a restarted trace).

    python benchmarks/results/step-python-s56/compile_warm_up.py native|int8
"""

from __future__ import annotations

import sys
import time

import torch._dynamo.utils

from llmserve import LLM
from llmserve.engine import llm_engine

run_to_completion = llm_engine.LLMEngine._run_to_completion


def timed(self, requests, *args, **kwargs):
    start = time.perf_counter()
    out = run_to_completion(self, requests, *args, **kwargs)
    print(f"{requests[0][0]}: {len(requests)} requests, {time.perf_counter() - start:.1f} s", flush=True)
    return out


llm_engine.LLMEngine._run_to_completion = timed
options = {"dtype": "float32", "kv_cache_memory_gb": 0.25, "max_model_len": 2048, "compile": True}
if sys.argv[1] == "int8":
    options.update(quantization="int4", int8_activations=True, long_prefill_token_threshold=512,
                   max_num_batched_tokens=4096)
else:
    options.update(quantization="none", kernels="native")
start = time.perf_counter()
LLM(**options)
print(f"LLM() {time.perf_counter() - start:.1f} s", flush=True)
times = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
print("\n".join(line for line in times.splitlines() if "compile_attempt" in line or "compile_inner" in line))
