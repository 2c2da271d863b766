#!/usr/bin/env python3
"""Greedy tokens of llmserve equal transformers on the same GGUF, for a model too big for CI's time and
memory (issue 20: Qwen2.5-Coder-1.5B; the 0.5B is checked in tests/models/test_qwen.py).

Why a script: both sides in float32 are 7 GB each for the 1.5B, so the reference runs first and is freed
before our engine loads. The check itself is the tests' own (tests/greedy.py): batched, then one prompt
alone, then every KV block back.

  python benchmarks/greedy_vs_transformers.py --model qwen2.5-coder-1.5b --tokens 24
  python benchmarks/greedy_vs_transformers.py --model qwen2.5-coder-1.5b --quantization int4+int8

With `--quantization`, the reference is transformers on the values that method computes with
(`quantized_reference`: the file's own grids kept where the method keeps them), llmserve runs that method.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from llmserve import LLM  # noqa: E402 - after the sys.path fix-up for direct runs
from llmserve.evaluate.reference import quantized_reference, reference_greedy, reference_model  # noqa: E402
from llmserve.loader import load_checkpoint, load_tokenizer  # noqa: E402
from tests.greedy import assert_greedy_equals  # noqa: E402

PROMPTS = ["def is_prime(n):", "The three laws of thermodynamics are", "# Sort a list of tuples by their second item\n",
           "<|im_start|>user\nWrite a Python function that merges two dicts.<|im_end|>\n<|im_start|>assistant\n"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--quantization", default="none", help="llmserve's method; the reference takes its values")
    ap.add_argument("--out", type=Path, default=None, help="write the tokens and the verdict as JSON")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    start = time.perf_counter()
    print(f"[greedy] transformers, float32, {args.model} ...", flush=True)
    ref = reference_model(args.model, torch.float32)
    if args.quantization != "none":
        ckpt = load_checkpoint(args.model)
        grids, int8_grids = ckpt.int4_grids, ckpt.int8_grids
        del ckpt
        ref = quantized_reference(ref, args.quantization, grids, int8_grids)
        gc.collect()
    expected = [reference_greedy(ref, ids, args.tokens) for ids in prompts]
    del ref
    gc.collect()
    print(f"[greedy] reference done in {time.perf_counter() - start:.0f} s; llmserve, float32, weights "
          f"{args.quantization}", flush=True)
    llm = LLM(args.model, dtype="float32", quantization=args.quantization, kv_cache_memory_gb=0.5, max_model_len=1024)
    try:
        assert_greedy_equals(llm, prompts, expected, single=len(prompts) - 1)
        verdict = "equal"
    except AssertionError:
        verdict = "DIFFERENT"
    for text, ids in zip(PROMPTS, expected, strict=True):
        print(f"[greedy] {text[:40]!r} -> {tokenizer.decode(ids)[:60]!r}")
    print(f"[greedy] {args.model} ({args.quantization}): {len(prompts)} prompts x {args.tokens} tokens, batched and "
          f"alone: {verdict} ({time.perf_counter() - start:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "quantization": args.quantization, "prompts": PROMPTS,
                                        "expected": expected, "verdict": verdict}, indent=1))
    return 0 if verdict == "equal" else 1


if __name__ == "__main__":
    sys.exit(main())
