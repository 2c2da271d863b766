"""float32 products at SmolLM2's shapes: `F.linear` (MKL's sgemm) against oneDNN's packed product, us per call.
`--decode` (session 59): decode sizes (1, 3, 8, 20 tokens), SmolLM2's and Qwen2.5-0.5B's shapes, two threads.

    .venv/bin/python benchmarks/results/dense-large-steps-s49/products_f32.py
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python \
        benchmarks/results/dense-large-steps-s49/products_f32.py
    .venv/bin/python benchmarks/results/dense-large-steps-s49/products_f32.py --decode
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
DECODE = [(1536, 576), (576, 1536), (49152, 576), (4864, 896), (896, 4864), (151936, 896)]  # (out, in)


def per_call_us(f: Callable[[], torch.Tensor], calls: int) -> float:
    for _ in range(10):
        f()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e6


def main(shapes: list[tuple[int, int]], token_counts: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features) * 0.05
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        calls = 20 if out_features > 100000 else 50 if out_features > 10000 else 200
        for tokens in token_counts:
            x = torch.randn(tokens, in_features)
            def plain(x: torch.Tensor = x, weight: torch.Tensor = weight) -> torch.Tensor:
                return torch.nn.functional.linear(x, weight)

            def onednn_packed(x: torch.Tensor = x, packed: torch.Tensor = packed) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            mkl, onednn = per_call_us(plain, calls), per_call_us(onednn_packed, calls)
            difference = (plain() - onednn_packed()).abs().max().item()
            print(f"{out_features}x{in_features} {tokens} tokens: MKL {mkl:.0f} us, oneDNN packed {onednn:.0f} us "
                  f"({onednn / mkl:.2f}), largest difference {difference:.1e}", flush=True)


if __name__ == "__main__":
    if "--decode" in sys.argv:
        torch.set_num_threads(2)
        main(DECODE, (1, 3, 8, 20))
    else:
        main(SMOLLM2, (17, 32, 64, 256))
