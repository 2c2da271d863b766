"""float32 products at decode sizes: MKL's `F.linear` against oneDNN's packed product (us a call, and the largest
difference of their outputs), two threads, SmolLM2-135M's and Qwen2.5-0.5B's shapes as (in, out) (session 59).

    .venv/bin/python benchmarks/results/float32-s59/products.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

SHAPES = [(576, 1536), (1536, 576), (576, 49152), (896, 4864), (4864, 896), (896, 151936)]


def us_a_call(fn: Callable[[], torch.Tensor], calls: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.set_num_threads(2)
    for k, n in SHAPES:
        weight = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        for tokens in (1, 3, 8, 20):
            x = torch.randn(tokens, k)

            def mkl(x: torch.Tensor = x, weight: torch.Tensor = weight) -> torch.Tensor:
                return F.linear(x, weight)

            def onednn(x: torch.Tensor = x, packed: torch.Tensor = packed) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            a, b = us_a_call(mkl), us_a_call(onednn)
            diff = (mkl() - onednn()).abs().max().item()
            print(f"{k} x {n}, {tokens:2d} tokens: MKL {a:9.1f} us  oneDNN {b:9.1f} us  x{a / b:4.1f}  "
                  f"largest difference {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
