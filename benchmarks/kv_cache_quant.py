#!/usr/bin/env python3
"""A 1-byte KV cache (int8, fp8_e4m3) against the model dtype's: capacity, attention speed, long-context decoding.

    .venv/bin/python benchmarks/kv_cache_quant.py                     # smollm2, ~5 minutes on 2 cores
    .venv/bin/python benchmarks/kv_cache_quant.py --model qwen2.5-coder-1.5b --contexts 2048
    .venv/bin/python benchmarks/kv_cache_quant.py --contexts 160 192 --output-len 8 --rounds 1 --formats auto,int8 \
        --repeats 2 --out /tmp/kv                                      # a smoke run

Why: a 1-byte cache holds ~1.9x the tokens in the same memory; whether it is also faster (int8: an integer VNNI
kernel reads half the bytes) or slower (fp8: a table lookup in a portable loop) decides whether it is a capacity
option only. Its quality is `llmserve eval --kv-cache-dtype` (docs/performance.md, "KV cache quantization").

1. The kernel alone: `paged_decode_attention` at batch len(--contexts) over those contexts (random caches of the
   model's shape, blocks scattered as a busy pool leaves them), per cache format, median of `--repeats` calls.
2. The engine: len(--contexts) requests with prompts of real text (gensim's Lee corpus) filling those contexts,
   greedy, `--output-len` tokens each; decode tokens/s over the steps after every prompt is cached (all decodes at
   the long contexts; prefix caching off). Formats are interleaved over rounds, so a noisy neighbour slows them
   alike; the ratios are what to read.
Writes <out>.json and <out>.md (default benchmarks/results/kv-cache-quant/<host>).
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

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_vs_peers import host_tag  # noqa: E402

ALL_FORMATS = ("auto", "int8", "fp8_e4m3")


def kernel_times(num_heads: int, num_kv_heads: int, head_dim: int, contexts: list[int], repeats: int,
                 formats: tuple[str, ...]) -> dict:
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
    caches = {fmt: (k.bfloat16(), v.bfloat16()) if fmt == "auto" else
              (quantize_rows(k, QUANTIZED_KV_DTYPES[fmt]), quantize_rows(v, QUANTIZED_KV_DTYPES[fmt]))
              for fmt in formats}
    times: dict[str, list[float]] = {fmt: [] for fmt in formats}
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


def engine_decode(llms: dict[str, LLM], prompts: list[list[int]], output_len: int, rounds: int) -> dict:
    formats = list(llms)
    capacity = {fmt: llm.engine.kv_cache.num_blocks * llm.engine.plan.kv_cache.block_size for fmt, llm in llms.items()}
    runs: dict[str, list[float]] = {fmt: [] for fmt in formats}
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
    parser.add_argument("--formats", type=lambda s: tuple(s.split(",")), default=ALL_FORMATS,
                        help="cache formats, the first the baseline (default: auto,int8,fp8_e4m3)")
    parser.add_argument("--repeats", type=int, default=30, help="kernel calls per format (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="path stem of the .json and .md (default benchmarks/results/kv-cache-quant/<host>)")
    args = parser.parse_args()
    formats = args.formats
    args.out = args.out or REPO / "benchmarks" / "results" / "kv-cache-quant" / host_tag()
    assert load_cpu_kernels(), "the native kernels must build here"
    llms = {fmt: LLM(args.model, kv_cache_dtype=fmt, enable_prefix_caching=False) for fmt in formats}
    first = llms[formats[0]]
    cfg, tok = first.engine.model_config, first.get_tokenizer()
    print(f"kernel: batch {len(args.contexts)}, contexts {args.contexts}", flush=True)
    kernel = kernel_times(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, args.contexts, args.repeats, formats)
    for fmt, row in kernel.items():
        print(f"  {fmt:9s} {row['ms']:.3f} ms a layer, {row['GB/s']:.1f} GB/s of KV", flush=True)
    text = tok.encode(perplexity_text())
    prompts, start = [], 0
    for n in args.contexts:
        n = n - args.output_len
        prompts.append(text[start : start + n])
        start += n
    print(f"engine: {args.model}, {len(prompts)} requests, prompts {[len(p) for p in prompts]} tokens", flush=True)
    engine = engine_decode(llms, prompts, args.output_len, args.rounds)
    host = open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(":\t ")
    result = {"model": args.model, "contexts": args.contexts, "output_len": args.output_len, "kernel": kernel,
              "engine": engine, "host": host}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    base = engine[formats[0]]["decode_tok_s"]
    lines = [f"# KV cache formats, {args.model} ({result['host']})", "",
             f"| format | KV tokens (same memory) | kernel ms / layer | kernel GB/s | decode tok/s | vs {formats[0]} |",
             "|---|---:|---:|---:|---:|---:|"]
    for fmt in formats:
        e, k = engine[fmt], kernel[fmt]
        lines.append(f"| {fmt} | {e['kv_tokens']} | {k['ms']:.3f} | {k['GB/s']:.1f} | {e['decode_tok_s']:.1f} | "
                     f"{e['decode_tok_s'] / base:.2f}x |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
