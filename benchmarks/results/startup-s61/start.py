"""Seconds to build `LLM(model)` with `--quantization` as given, and the process peak RSS after it: one process each,
alternated between two checkouts by the caller (`startup-s61/README` gives the lines).

    .venv/bin/python benchmarks/results/startup-s61/start.py auto qwen2.5-coder-1.5b
"""

from __future__ import annotations

import resource
import sys
import time

from llmserve import LLM

start = time.perf_counter()
llm = LLM(sys.argv[2], quantization=sys.argv[1])
print(f"{sys.argv[1]}: LLM() {time.perf_counter() - start:.1f} s, peak RSS "
      f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB, weights {llm.engine.plan.weights}")
