#!/usr/bin/env python3
"""A 1-byte KV cache against the model dtype's: capacity, decode attention speed, long-context decoding.

    .venv/bin/python benchmarks/kv_cache_quant.py                     # smollm2, ~5 minutes on 2 cores
    .venv/bin/python benchmarks/kv_cache_quant.py --model qwen2.5-coder-1.5b --contexts 2048

1. The kernel alone: `paged_decode_attention` at batch 8 over contexts of 2-4k tokens (random caches of the
   model's shape), per cache format, median of repeated calls.
2. The engine: 8 requests with prompts of 2-4k tokens of real text (gensim's Lee corpus), greedy, 128 output
   tokens each; decode tokens/s over the steps after every prompt is cached (all decodes at 2-4k tokens of
   context; prefix caching off). Formats are interleaved over rounds,
   so a noisy neighbour slows them alike; the ratios are what to read.
Writes benchmarks/results/kv_cache_quant.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.evaluate.datasets import perplexity_text  # noqa: E402
from llmserve.kernels import load_cpu_kernels  # noqa: E402
from llmserve.kv_cache.kv_quant import QUANTIZED_KV_DTYPES, quantize_rows  # noqa: E402

FORMATS = ("auto", "int8", "fp8_e4m3")


def kernel_times(num_heads: int, num_kv_heads: int, head_dim: int, contexts: list[int], repeats: int) -> dict:
    """Median seconds of one decode-attention call (one layer) per format, batch = len(contexts)."""
    block_size = 16
    gen = torch.Generator().manual_seed(0)
    blocks_per = [-(-c // block_size) for c in contexts]
    num_blocks = sum(blocks_per) + 1
    k = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    v = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    q = torch.randn(len(contexts), num_heads, head_dim, generator=gen).bfloat16()
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # blocks scattered, as a busy pool leaves them
    width = max(blocks_per)
    table = torch.zeros(len(contexts), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per):
        table[b, :n] = perm[start : start + n]
        start += n
    lens = torch.tensor(contexts, dtype=torch.int32)
    caches = {"auto": (k.bfloat16(), v.bfloat16())}
    caches |= {fmt: (quantize_rows(k, QUANTIZED_KV_DTYPES[fmt]), quantize_rows(v, QUANTIZED_KV_DTYPES[fmt]))
               for fmt in FORMATS[1:]}
    times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for _ in range(repeats):
        for fmt, (kc, vc) in caches.items():
            t = time.perf_counter()
            torch.ops.llmserve.paged_decode_attention(q, kc, vc, table, lens, head_dim**-0.5)
            times[fmt].append(time.perf_counter() - t)
    kv_bytes = {fmt: kc.element_size() * kc[0, 0, 0].numel() * 2 * sum(contexts) * num_kv_heads
                for fmt, (kc, _) in caches.items()}
    return {fmt: {"ms": 1e3 * statistics.median(ts), "GB/s": kv_bytes[fmt] / statistics.median(ts) / 1e9}
            for fmt, ts in times.items()}


def decode_rate(llm: LLM, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """Output tokens per second of the decode-only steps: the requests are added together and stepped until
    every prompt is in the cache (each has its first token), then the remaining steps, all decodes at 2-4k
    tokens of context, are timed. Prefill is left out by construction rather than subtracted: it takes ~5x
    as long as the decoding here, and its run-to-run noise would swamp a difference."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    requests = [engine.requests[i] for i in ids]
    while any(not r.output_token_ids for r in requests):
        engine.step()
    before = sum(len(r.output_token_ids) for r in requests)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (len(prompts) * output_len - before) / (time.perf_counter() - start)


def engine_decode(model: str, prompts: list[list[int]], output_len: int, rounds: int) -> dict:
    llms = {fmt: LLM(model, kv_cache_dtype=fmt, enable_prefix_caching=False) for fmt in FORMATS}
    capacity = {fmt: llm.engine.kv_cache.num_blocks * llm.engine.plan.kv_cache.block_size for fmt, llm in llms.items()}
    runs: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for r in range(rounds):
        for fmt, llm in llms.items():
            rate = decode_rate(llm, prompts, output_len, f"round{r}")
            runs[fmt].append(rate)
            print(f"  round {r + 1}/{rounds} {fmt:9s} decode {rate:7.1f} tok/s", flush=True)
    return {fmt: {"decode_tok_s": statistics.median(v), "runs": v, "kv_tokens": capacity[fmt]}
            for fmt, v in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 2560, 3072, 3584, 4000, 2304, 2816, 3328])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_cache_quant")
    args = parser.parse_args()
    assert load_cpu_kernels(), "the native kernels must build here"
    probe = LLM(args.model, kv_cache_memory_gb=0.01)
    cfg = probe.engine.model_config
    tok = probe.get_tokenizer()
    del probe
    print(f"kernel: batch {len(args.contexts)}, contexts {args.contexts}", flush=True)
    kernel = kernel_times(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.contexts, repeats=30)
    for fmt, row in kernel.items():
        print(f"  {fmt:9s} {row['ms']:.3f} ms a layer, {row['GB/s']:.1f} GB/s of KV", flush=True)
    text = tok.encode(perplexity_text())
    prompts, start = [], 0
    for n in args.contexts:
        n = n - args.output_len
        prompts.append(text[start : start + n])
        start += n
    print(f"engine: {args.model}, {len(prompts)} requests, prompts {[len(p) for p in prompts]} tokens", flush=True)
    engine = engine_decode(args.model, prompts, args.output_len, args.rounds)
    host = open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(":\t ")
    result = {"model": args.model, "contexts": args.contexts, "output_len": args.output_len, "kernel": kernel,
              "engine": engine, "host": host}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    base = engine["auto"]["decode_tok_s"]
    lines = [f"# KV cache formats, {args.model} ({result['host']})", "",
             "| format | KV tokens (same memory) | kernel ms / layer | kernel GB/s | decode tok/s | vs auto |",
             "|---|---:|---:|---:|---:|---:|"]
    for fmt in FORMATS:
        e, k = engine[fmt], kernel[fmt]
        lines.append(f"| {fmt} | {e['kv_tokens']} | {k['ms']:.3f} | {k['GB/s']:.1f} | {e['decode_tok_s']:.1f} | "
                     f"{e['decode_tok_s'] / base:.2f}x |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
