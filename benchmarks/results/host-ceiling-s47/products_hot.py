"""SmolLM2's three int4 product shapes (gate/up 3072x576, o 576x576, down 576x1536) at one token on the native
kernel, the same weight repeated (cache-resident where it fits), on one thread and on two: what the loops compute
per second beside what memory delivers. Run from the checkout whose build it should load (a `-mno-avx512f` copy
runs the AVX2 loops).

    taskset -c 0,1 .venv/bin/python benchmarks/results/host-ceiling-s47/products_hot.py
"""

import sys
import time

import torch

sys.path.insert(0, ".")

from llmserve.kernels import native_quantized_kernels  # noqa: E402
from llmserve.kernels.quantized_gemv import pack_int4  # noqa: E402


def main() -> None:
    assert native_quantized_kernels(), "the native kernels did not build"
    generator = torch.Generator().manual_seed(0)
    for n, k in [(3072, 576), (576, 576), (576, 1536)]:
        q = torch.randint(0, 16, (n, k), generator=generator)
        scales = torch.rand(n, k // 32, generator=generator) * 0.01
        mins = -torch.rand(n, k // 32, generator=generator) * 0.05
        packed = pack_int4(q, scales, mins, factored=None)
        x = torch.randn(1, k, dtype=torch.bfloat16, generator=generator)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for _ in range(200):
                torch.ops.llmserve.int4_gemv(x, packed, n, 2)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(500):
                    torch.ops.llmserve.int4_gemv(x, packed, n, 2)
                best = min(best, (time.perf_counter() - start) / 500)
            print(f"{n}x{k} threads {threads}: {best * 1e6:.2f} us, {packed.nbytes / best / 1e9:.1f} GB/s (hot), "
                  f"{packed.nbytes / 1e3:.0f} KB")


if __name__ == "__main__":
    main()
