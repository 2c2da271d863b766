"""What handing work to the second thread costs, bare: `at::parallel_for` over two empty items, a bare
`#pragma omp parallel` of two threads, and a barrier of two flags (each thread stores its round, waits for the
other's) between the same two threads inside one region, what one parallel region a step would pay instead.

    taskset -c 0,1 .venv/bin/python benchmarks/results/host-ceiling-s46/fork_cost.py
"""

from __future__ import annotations

import tempfile

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <atomic>
#include <chrono>
#include <immintrin.h>
using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point start, int64_t reps) {
  return std::chrono::duration<double>(Clock::now() - start).count() / reps * 1e6;
}
double loop_at(int64_t reps) {
  auto start = Clock::now();
  for (int64_t i = 0; i < reps; ++i) at::parallel_for(0, 2, 1, [&](int64_t, int64_t) {});
  return us_since(start, reps);
}
double loop_omp(int64_t reps) {
  auto start = Clock::now();
  for (int64_t i = 0; i < reps; ++i) {
#pragma omp parallel num_threads(2)
    { asm volatile("" ::: "memory"); }
  }
  return us_since(start, reps);
}
struct alignas(64) Flag { std::atomic<int64_t> round{0}; };
double loop_barrier(int64_t reps) {
  Flag flags[2];
  double us = 0;
#pragma omp parallel num_threads(2)
  {
    const int t = omp_get_thread_num();
    auto start = Clock::now();
    for (int64_t i = 1; i <= reps; ++i) {
      flags[t].round.store(i, std::memory_order_release);
      while (flags[1 - t].round.load(std::memory_order_acquire) < i) _mm_pause();
    }
    if (t == 0) us = us_since(start, reps);
  }
  return us;
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as build:
        probes = load_inline("fork_cost", cpp_sources=SOURCE, functions=["loop_at", "loop_omp", "loop_barrier"],
                             extra_cflags=["-O2", "-fopenmp", "-march=native"], extra_ldflags=["-fopenmp"],
                             build_directory=build)
    torch.set_num_threads(2)

    def best(call) -> float:
        return min(call() for _ in range(5))

    print(f"at::parallel_for {best(lambda: probes.loop_at(20000)):.2f} us; "
          f"omp parallel {best(lambda: probes.loop_omp(20000)):.2f} us; "
          f"two-flag barrier {best(lambda: probes.loop_barrier(200000)):.3f} us")


if __name__ == "__main__":
    main()
