"""Decode attention alone, SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16): us a call.

Usage: attention_us.py LABEL [--dtype float32|bfloat16] [--batch 32] [--context 280] [--calls 200] [--layers 30]
       [--scatter] [--heads 9,3,64]
Each batch row has its own blocks (no shared prefix), in order as a fresh engine hands them out (--scatter: at
random ids), in caches larger than the L2 as in a step.
"""

from __future__ import annotations

import argparse
import time

import torch

from llmserve.kernels import load_cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=280)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--heads", default="9,3,64")
    parser.add_argument("--scatter", action="store_true", help="blocks at random ids (a fresh engine's are in order)")
    parser.add_argument("--layers", type=int, default=30, help="caches used in turn (1: K/V stay in cache)")
    args = parser.parse_args()
    assert load_cpu_kernels()
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    block = 16
    per_seq = -(-args.context // block)
    # `layers` caches, one used per call in turn, so K/V come from memory as in a step (30)
    layers = args.layers
    num_blocks = args.batch * per_seq + 8
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype),
               torch.randn(num_blocks, kv_heads, block, head_dim, generator=gen).to(dtype)) for _ in range(layers)]
    ids = torch.randperm(num_blocks, generator=gen) if args.scatter else torch.arange(num_blocks)
    table = ids[: args.batch * per_seq].view(args.batch, per_seq).to(torch.int32)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, heads, head_dim, generator=gen).to(dtype)
    op = torch.ops.llmserve.paged_decode_attention
    for k, v in caches:
        op(q, k, v, table, lens, head_dim**-0.5)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(args.calls):
            k, v = caches[i % layers]
            op(q, k, v, table, lens, head_dim**-0.5)
        times.append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"{args.label} {args.dtype} b{args.batch} ctx{args.context}: us a call "
          + " ".join(f"{t:.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
