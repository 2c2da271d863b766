"""`python -m llmserve.kernels`: build the native kernels now (setup does this), not at first serve."""

import sys
import time

from llmserve.kernels import build_directory, load_cpu_kernels

start = time.perf_counter()
print("kernels: building the native CPU kernels (first time ~1 min) ...", flush=True)
if not load_cpu_kernels():
    sys.exit("kernels: build failed; the engine will use its PyTorch attention path")
print(f"kernels: ready in {build_directory()} ({time.perf_counter() - start:.1f} s)")
