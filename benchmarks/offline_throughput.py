"""Offline throughput: our engine vs transformers `generate` (naive: one request at a time; static
batching: padded batches of 16), same prompts, same dtype, in one process, back to back.

    .venv/bin/python benchmarks/offline_throughput.py            # 64 prompts, 256 in, 128 out

The naive baseline handles one request at a time, so its tok/s does not depend on how many requests
it is given: it runs a subset (--naive-requests) to keep the run short, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch

from llmserve import LLM, SamplingParams
from llmserve.evaluate.reference import reference_model


def make_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = "the a model token cache memory batch request server latency queue block page kernel".split()
    prompts = []
    for i in range(n):
        text = f"Request {i}: " + " ".join(rng.choice(words) for _ in range(input_len * 2))
        prompts.append(tokenizer.encode(text)[:input_len])
    return prompts


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def run_hf(model, prompts: list[list[int]], output_len: int, batch_size: int, label: str) -> dict:
    tokens = 0
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size])  # equal lengths: no padding needed
        with torch.inference_mode():
            out = model.generate(
                batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                min_new_tokens=output_len, do_sample=False, pad_token_id=2,
            )
        tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        done = min(i + batch_size, len(prompts))
        rate = tokens / (time.perf_counter() - start)
        print(f"  {label}: {done}/{len(prompts)} requests, {rate:.1f} tok/s", flush=True)
    elapsed = time.perf_counter() - start
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--naive-requests", type=int, default=8)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "offline_throughput.json"))
    args = ap.parse_args()

    llm = LLM(dtype=args.dtype, kv_cache_memory_gb=1.0, max_num_seqs=args.num_prompts)
    dtype = llm.engine.dtype
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.input_len, args.seed)
    print(f"ours: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, {dtype}")
    ours = run_ours(llm, prompts, args.output_len)
    del llm

    model = reference_model(None, dtype)  # the same dequantized weights, run by transformers
    naive = run_hf(model, prompts[: args.naive_requests], args.output_len, 1, "naive (batch 1)")
    static = run_hf(model, prompts, args.output_len, args.static_batch, f"static batching ({args.static_batch})")

    result = {
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__},
        "config": vars(args) | {"dtype": str(dtype)},
        "ours": ours, "naive": naive, "static": static,
        "ratio_vs_naive": ours["tok_s"] / naive["tok_s"],
        "ratio_vs_static": ours["tok_s"] / static["tok_s"],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("\n| engine | requests | output tokens | seconds | output tok/s |\n|---|---:|---:|---:|---:|")
    for name, r in (("llmserve", ours), ("HF naive (1 at a time)", naive),
                    (f"HF static batching ({args.static_batch})", static)):
        print(f"| {name} | {r['requests']} | {r['output_tokens']} | {r['seconds']:.1f} | {r['tok_s']:.1f} |")
    print(f"\nours / naive = {result['ratio_vs_naive']:.2f}x, ours / static = {result['ratio_vs_static']:.2f}x")


if __name__ == "__main__":
    main()
