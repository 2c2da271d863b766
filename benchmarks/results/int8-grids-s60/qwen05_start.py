"""Seconds to build `LLM("qwen2.5-coder-0.5b")` with the weights as loaded (the default before session 60) and with the
default now (int4 + int8 on the file's grids), and the process's peak RSS after each; alternated, one process each.

    .venv/bin/python benchmarks/results/int8-grids-s60/qwen05_start.py none|auto
"""

from __future__ import annotations

import resource
import sys
import time

from llmserve import LLM

start = time.perf_counter()
llm = LLM("qwen2.5-coder-0.5b", quantization=sys.argv[1])
print(f"{sys.argv[1]}: LLM() {time.perf_counter() - start:.1f} s, peak RSS "
      f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB, weights {llm.engine.plan.weights}")
