"""The decode attention kernel alone, SmolLM2's shape (9 heads, 3 KV heads, head_dim 64, bf16 cache), with K/V that
has left the cache as in the engine's step: 128 layers' caches (~100 MB at 1024 tokens) walked in turn, a 512 MB
sum between rounds. Prints us a call (median of the rounds) and the K/V read rate, beside the sum's rate.

    taskset -c 0,1 .venv/bin/python benchmarks/results/host-ceiling-s46/cold_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[3]), help="the checkout to load")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--shuffle", action="store_true", help="the context's blocks in random order")
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    import torch

    from llmserve.kernels import load_cpu_kernels

    load_cpu_kernels()
    torch.set_num_threads(args.threads)
    blocks = -(-args.context // 16)
    caches = [(torch.randn(blocks, 3, 16, 64).bfloat16(), torch.randn(blocks, 3, 16, 64).bfloat16())
              for _ in range(args.layers)]
    q = torch.randn(1, 9, 64).bfloat16()
    order = torch.randperm(blocks) if args.shuffle else torch.arange(blocks)
    table = order.to(torch.int32).unsqueeze(0)
    lens = torch.tensor([args.context], dtype=torch.int32)
    attention = torch.ops.llmserve.paged_decode_attention
    buffer = torch.ones(2**27)
    calls, rates = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for k, v in caches:
            attention(q, k, v, table, lens, 0.125)
        calls.append((time.perf_counter() - start) / args.layers)
        start = time.perf_counter()
        buffer.sum()
        rates.append(buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
    call = statistics.median(calls)
    kv_bytes = args.context * 3 * 64 * 2 * 2
    print(f"{args.context} tokens, {args.threads} thread(s): {call * 1e6:.2f} us a call (best {min(calls) * 1e6:.2f}), "
          f"K/V read at {kv_bytes / call / 1e9:.1f} GB/s; sum {statistics.median(rates):.1f} GB/s")


if __name__ == "__main__":
    main()
