"""The decode attention kernel alone, SmolLM2's shape (9 heads, 3 KV heads, head_dim 64), K/V in cache: us a call.

    .venv/bin/python benchmarks/results/attention-runs-s45/attention_kernel.py --cache int8 --context 1024 --threads 1

Session 45 ran it once per build, alternated (the build before in a git worktree: `--root /tmp/base`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[3]), help="the checkout to load")
    parser.add_argument("--cache", choices=["bfloat16", "int8"], default="bfloat16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1500)
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    import torch

    from llmserve.kernels import load_cpu_kernels
    from llmserve.kv_cache.kv_quant import row_width

    load_cpu_kernels()
    torch.set_num_threads(args.threads)
    layers, blocks = 8, -(-args.context // 16) + 8
    if args.cache == "int8":
        def cache() -> torch.Tensor:
            rows = torch.randint(-100, 100, (blocks, 3, 16, row_width(64, torch.int8)), dtype=torch.int8)
            rows[..., 64:].view(torch.float32).fill_(0.01)  # each row's scale
            return rows
    else:
        def cache() -> torch.Tensor:
            return torch.randn(blocks, 3, 16, 64).bfloat16()
    caches = [(cache(), cache()) for _ in range(layers)]
    q = torch.randn(1, 9, 64).bfloat16()
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
    lens = torch.tensor([args.context], dtype=torch.int32)
    attention = torch.ops.llmserve.paged_decode_attention
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for k, v in caches:
            attention(q, k, v, table, lens, 0.125)
        best = min(best, time.perf_counter() - start)
    print(f"{args.cache} cache, {args.context} tokens, {args.threads} thread(s): {best / layers * 1e6:.2f} us a call")


if __name__ == "__main__":
    main()
