"""Where `LLM(model)`'s start goes: seconds per phase (summed over the target and a draft) and the resident memory.

Usage: phases.py MODEL [--small]   (--small: kv_cache_memory_gb=0.25, max_model_len=2048; else the defaults)
Run from the checkout to measure (PYTHONPATH picks the build). The phases are timed by wrapping the functions the
engine calls, so a build that lacks one (an older base) reports what it has.
"""

from __future__ import annotations

import argparse
import collections
import functools
import resource
import time

import llmserve.engine.llm_engine as engine_module
import llmserve.engine.model_runner as runner_module
import llmserve.loader.gguf as gguf_module
import llmserve.quantization.weight_only as weight_only
from llmserve import LLM

seconds: dict[str, float] = collections.defaultdict(float)


def timed(owner: object, name: str, label: str) -> None:
    if not hasattr(owner, name):
        return
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    timed(gguf_module, "_dense", "dequantize")
    timed(gguf_module, "gguf_tokenizer", "tokenizer")
    timed(engine_module, "load_checkpoint", "load_checkpoint")
    timed(runner_module, "build_model", "build_model")
    timed(runner_module, "quantize_model", "quantize_model")
    timed(weight_only, "_quantize_int4", "  of which int4 levels")
    timed(weight_only, "_int6_levels", "  of which Q6_K levels")
    timed(engine_module.LLMEngine, "_calibrate_int8_activations", "int8 calibration")
    sizes = dict(kv_cache_memory_gb=0.25, max_model_len=2048) if args.small else {}
    start = time.perf_counter()
    LLM(args.model, **sizes)
    total = time.perf_counter() - start
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * resource.getpagesize() / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{args.model}: LLM() {total:.1f} s, resident {resident:.2f} GB, peak {peak:.2f} GB; "
          + ", ".join(f"{k} {v:.2f}" for k, v in seconds.items()), flush=True)


if __name__ == "__main__":
    main()
