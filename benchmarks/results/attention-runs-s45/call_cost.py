"""What a native product call costs beside its weights: a C++ loop over the dispatched `int4_gemv` (no Python in
the loop) on 1 and 2 threads, and `at::empty` and an empty `at::parallel_for` alone.

    .venv/bin/python benchmarks/results/attention-runs-s45/call_cost.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from torch.utils.cpp_extension import load_inline  # noqa: E402

from llmserve.kernels import load_cpu_kernels  # noqa: E402

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <chrono>
using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point start, int64_t reps) {
  return std::chrono::duration<double>(Clock::now() - start).count() / reps * 1e6;
}
double loop_gemv(at::Tensor x, at::Tensor w, int64_t n, int64_t reps) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("llmserve::int4_gemv", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  auto start = Clock::now();
  for (int64_t i = 0; i < reps; ++i) op.call(x, w, n, 2);
  return us_since(start, reps);
}
double loop_empty(at::Tensor x, int64_t reps) {
  auto start = Clock::now();
  for (int64_t i = 0; i < reps; ++i) at::empty({1, 576}, x.options());
  return us_since(start, reps);
}
double loop_parallel(int64_t reps) {
  auto start = Clock::now();
  for (int64_t i = 0; i < reps; ++i) at::parallel_for(0, 2, 1, [&](int64_t, int64_t) {});
  return us_since(start, reps);
}
"""


def main() -> None:
    load_cpu_kernels()
    with tempfile.TemporaryDirectory() as build:
        probes = load_inline("call_cost", cpp_sources=SOURCE, functions=["loop_gemv", "loop_empty", "loop_parallel"],
                             extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"], build_directory=build)
    x = torch.randn(1, 576).bfloat16()
    # int4 weights in the layout without super-blocks (576 inputs: 18 groups of 32), random bytes: a call's time
    # does not depend on the values
    weights = {n: torch.randint(0, 255, (n // 16 * 18 * 320,), dtype=torch.uint8) for n in (16, 32, 576)}

    def best(call) -> float:
        return min(call() for _ in range(5))

    for threads in (1, 2):
        torch.set_num_threads(threads)
        gemv = [best(lambda n=n: probes.loop_gemv(x, weights[n], n, 20000)) for n in (16, 32, 576)]
        print(f"threads {threads}: int4_gemv x 576 inputs, 16 / 32 / 576 rows: {gemv[0]:.2f} / {gemv[1]:.2f} / "
              f"{gemv[2]:.2f} us; at::empty {best(lambda: probes.loop_empty(x, 20000)):.3f} us; "
              f"at::parallel_for over 2 empty items {best(lambda: probes.loop_parallel(20000)):.2f} us")


if __name__ == "__main__":
    main()
