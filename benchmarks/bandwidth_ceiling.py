"""One request's decode step against the host's memory-bandwidth ceiling, offline, with the step split piece by piece.

    .venv/bin/python benchmarks/bandwidth_ceiling.py                          # the default model, as served
    .venv/bin/python benchmarks/bandwidth_ceiling.py --model qwen2.5-coder-1.5b --steps 16 --repeats 4
    taskset -c 0,1 python benchmarks/bandwidth_ceiling.py --shape smollm2-135m --threads 2   # a host without the files
    .venv/bin/python benchmarks/bandwidth_ceiling.py --steps 2 --repeats 1 --out /tmp/ceiling.json   # a smoke run

Why: at one request a decode step must read every weight once, so the bytes of a step's weights over the rate the
host reads memory at is the floor of a step, and the share of it a step reaches says how much of the step is
anything but weights. docs/performance.md, "The one-call decode step", has the figures per host.

The ceiling: the bytes of a one-token step's weights (the layers' products and the output head; not the embedding
table, of which a step reads one row) over the rate this process's threads read memory at, a 1 GiB float32 `sum`
measured beside every timed stretch because a shared host's rate moves. Stretches of steps alternate with those
reads; per stretch: the step, its split (the decoder layers, the output head, the rest: scheduling, inputs,
sampling), the step as a share of the ceiling, and the state of the host's two CPUs (below). Then, where the
layers run as one native call, stretches with that call timed piece by piece (`run_timed`): each piece of a
layer in us, its share of the step, and for the products the rate they read their weights at.

`--shape` builds the model from a registered shape with random weights (a lent machine has no GGUF file; a
step's time does not depend on the weights' values) and quantizes it as the registered file is served (int4
layers, int8 head). Speculation is off: one token a step is what the ceiling describes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.host import cpu_model  # noqa: E402
from llmserve.quantization.weight_arena import streamed_weights  # noqa: E402


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token step reads from the weights: the quantized linears' packed weights and scales (what the
    weight arena places), else each dense linear's weight and bias."""
    quantized = streamed_weights(model)
    if quantized:
        return sum(module._buffers[name].nbytes for module, name in quantized)
    return sum(p.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear)
               for p in (m.weight, m.bias) if p is not None)


def read_rate(buffer: torch.Tensor) -> float:
    """GB/s of a `sum` over `buffer`, the best of three (the threads this process uses)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best / 1e9


# The state of a shared host's two CPUs, which it changes by turns and which moves a step's latency-bound pieces
# (docs/performance.md, "Hosts"): two threads hand a cache line back and forth, and the round trip says whether the
# two cores share an L3 (~50-110 ns on the AMD hosts) or sit on different dies (~310-400 ns); a fixed loop on each
# CPU says whether one runs slower (its physical core shared); a pointer chase, how long a load from DRAM takes. C,
# not Python: a Python loop's own ~50 ns a check would hide them.
_CORE_PROBES_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
static _Alignas(128) atomic_long flag;
static long rounds;
static int cpus[2];
static double elapsed;
static void pin(int cpu) {
  cpu_set_t set; CPU_ZERO(&set); CPU_SET(cpu, &set); pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}
static void* answer(void* unused) {
  pin(cpus[1]);
  for (long i = 0; i < rounds; i++) {
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {}
    atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
  }
  return unused;
}
static void* ask(void* unused) {
  pin(cpus[0]);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < rounds; i++) {
    atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {}
  }
  clock_gettime(CLOCK_MONOTONIC, &b);
  elapsed = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
  return unused;
}
static int find_cpus(void) {  /* the first two CPUs this process may use */
  cpu_set_t set; sched_getaffinity(0, sizeof set, &set);
  int found = 0;
  for (int c = 0; c < CPU_SETSIZE && found < 2; c++) if (CPU_ISSET(c, &set)) cpus[found++] = c;
  return found;
}
static double spun;
static void* spin(void* which) {  /* a fixed loop of dependent multiply-adds on one CPU */
  pin(cpus[*(int*)which]);
  struct timespec a, b;
  volatile unsigned long sink;
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    unsigned long x = 1;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < 200000; i++) x = x * 6364136223846793005UL + (x >> 7);
    clock_gettime(CLOCK_MONOTONIC, &b);
    sink = x;
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    if (ns < best) best = ns;
  }
  (void)sink;
  spun = best / 1e3;
  return 0;
}
double loop_us(int which) {  /* on the first (0) or second (1) CPU; -1 without it */
  if (find_cpus() <= which) return -1;
  pthread_t t;
  pthread_create(&t, 0, spin, &which);
  pthread_join(t, 0);
  return spun;
}
static long* ring;  /* 256 MB of one random cycle of indices, one per 64-byte line */
enum { kRingLines = 1 << 22, kStride = 8 };
double chase_ns(long hops) {  /* ns a hop of a pointer chase through memory: the latency of a load from DRAM */
  if (!ring) {
    ring = malloc(sizeof(long) * kStride * kRingLines);
    if (!ring) return -1;
    long* order = malloc(sizeof(long) * kRingLines);
    unsigned long seed = 88172645463325252UL;
    for (long i = 0; i < kRingLines; i++) order[i] = i;
    for (long i = kRingLines - 1; i > 0; i--) {  /* Sattolo: one cycle through every line */
      seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17;
      long j = seed % i, t = order[i]; order[i] = order[j]; order[j] = t;
    }
    for (long i = 0; i < kRingLines; i++) ring[order[i] * kStride] = order[(i + 1) % kRingLines] * kStride;
    free(order);
  }
  static long at = 0;  /* each call goes on round the cycle: lines no call has read lately */
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < hops; i++) at = ring[at];
  clock_gettime(CLOCK_MONOTONIC, &b);
  return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / hops;
}
double round_trip_ns(long n) {  /* between the first two CPUs; -1 with fewer */
  if (find_cpus() < 2) return -1;
  double best = 1e30;
  for (int r = 0; r < 3; r++) {
    atomic_store(&flag, 0); rounds = n;
    pthread_t t1, t2;
    pthread_create(&t2, 0, answer, 0); pthread_create(&t1, 0, ask, 0);
    pthread_join(t1, 0); pthread_join(t2, 0);
    if (elapsed / n < best) best = elapsed / n;
  }
  return best;
}
"""


def core_probes() -> Callable[[], tuple[int, float, float, float] | None]:
    """A probe of this process's first two CPUs: the round trip between them in ns, a fixed loop's us on each (a CPU
    whose physical core another tenant shares runs it slower), and a load's latency from DRAM in ns (a pointer chase
    through 256 MB). None where it cannot run: one CPU, no compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return lambda: None
    with tempfile.TemporaryDirectory() as tmp:  # the loaded library outlives its file
        source, library = Path(tmp) / "core_probes.c", Path(tmp) / "core_probes.so"
        source.write_text(_CORE_PROBES_C)
        if subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", str(source), "-o", str(library)],
                          capture_output=True).returncode != 0:
            return lambda: None
        probes = ctypes.CDLL(str(library))
    probes.round_trip_ns.restype, probes.round_trip_ns.argtypes = ctypes.c_double, [ctypes.c_long]
    probes.loop_us.restype, probes.loop_us.argtypes = ctypes.c_double, [ctypes.c_int]
    probes.chase_ns.restype, probes.chase_ns.argtypes = ctypes.c_double, [ctypes.c_long]
    probes.chase_ns(100000)  # builds the ring; the first pass after that reads fast

    def measure() -> tuple[int, float, float, float] | None:
        ns = probes.round_trip_ns(20000)
        return (round(ns), probes.loop_us(0), probes.loop_us(1), probes.chase_ns(100000)) if ns > 0 else None
    return measure


class SplitTimer:
    """Wall time spent in named calls of the model during a stretch (they run on the calling thread)."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.seconds = dict.fromkeys(names, 0.0)
        for name in names:
            setattr(model, name, self._timed(getattr(model, name), name))

    def _timed(self, call, name: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = call(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            return out
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


class TimedStack:
    """Stands in for the runner's fused decode stack: the same call, each piece of a layer timed into `seconds`."""

    def __init__(self, stack) -> None:
        self.stack = stack
        self.pieces = torch.classes.llmserve.DecodeStack.pieces()
        self.seconds = torch.zeros(len(self.pieces), dtype=torch.float64)

    def run(self, *args: torch.Tensor) -> torch.Tensor:
        return self.stack.run_timed(*args, self.seconds)


# the pieces of a layer that are products, and the linear each reads
PRODUCTS = {"q/k/v": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate/up": "mlp.gate_up_proj",
            "down": "mlp.down_proj"}


def timed_stretch(engine, steps: int) -> tuple[float, TimedStack]:
    """`steps` engine steps with the fused stack timed piece by piece: seconds a step, and the timed stack."""
    runner = engine.runner
    plain = runner.fused_stack
    try:
        runner.fused_stack = timed = TimedStack(plain)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) / steps, timed
    finally:
        runner.fused_stack = plain


def piece_split(engine, steps: int, repeats: int) -> list[dict]:
    """Per piece of a decoder layer: us a layer and share of the step, the best of `repeats` stretches (by step
    time) of `steps` steps with the fused stack timed; a product's row also its weights' read rate."""
    model = engine.runner.model
    layers = len(model.layers)
    weight_bytes = {piece: step_weight_bytes(model.layers[0].get_submodule(name)) for piece, name in PRODUCTS.items()}
    stretches = [timed_stretch(engine, steps) for _ in range(repeats)]  # (seconds a step, its timed stack)
    step, timed = min(stretches, key=lambda stretch: stretch[0])
    rows = []
    for name, seconds in zip(timed.pieces, timed.seconds.tolist(), strict=True):
        layer_s = seconds / steps / layers
        row = {"piece": name, "us_a_layer": round(layer_s * 1e6, 2), "share_of_step": round(layer_s * layers / step, 3)}
        if name in weight_bytes:
            row["gb_s"] = round(weight_bytes[name] / layer_s / 1e9, 1)
        rows.append(row)
    print(f"\nthe decoder layers piece by piece (best of {repeats} timed stretches: {step * 1e3:.2f} ms a step)")
    print("| piece | us a layer | of the step | weights read at |")
    print("|---|---:|---:|---:|")
    for row in rows:
        rate = f"{row['gb_s']:.1f} GB/s" if "gb_s" in row else ""
        print(f"| {row['piece']} | {row['us_a_layer']:.2f} | {row['share_of_step']:.1%} | {rate} |")
    return rows


def build_shape(shape: str, folder: Path) -> str:
    from benchmarks.device_throughput import build

    print(f"building {shape} with random weights ...", flush=True)
    return build(shape, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a registered name or a path (default: the default model)")
    source.add_argument("--shape", help="a registered shape, random weights, quantized as its file is served")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--steps", type=int, default=32, help="steps per timed stretch (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=8, help="stretches (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="a JSON file for the rows")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape:
            llm = LLM(build_shape(args.shape, Path(tmp)), device="cpu", quantization="int4", speculative_config="off",
                      kv_cache_memory_gb=0.5, max_model_len=4096)
        else:
            llm = LLM(args.model, speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096)
    engine = llm.engine
    model = engine.runner.model
    weights = step_weight_bytes(model)
    plan = engine.plan.describe()
    print(plan, flush=True)
    timer = SplitTimer(model, ["forward_fused", "forward", "compute_logits"])
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(3, vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
    while engine.requests["probe"].num_computed_tokens < len(prompt):
        engine.step()
    for _ in range(8):  # allocator, caches
        engine.step()
    buffer = torch.ones(2**28, dtype=torch.float32)
    host = {"cpu": cpu_model() or platform.machine(), "threads": torch.get_num_threads(),
            "weights_mb": round(weights / 1e6, 1)}
    print(json.dumps(host), flush=True)
    cores = core_probes()
    print("| GB/s | core round trip ns | loop us, CPU 0 / 1 | DRAM load ns | ceiling ms | step ms | layers ms "
          "| head ms | rest ms | of the ceiling |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for _ in range(args.repeats):
        rate, probed = read_rate(buffer), cores()
        trip, loops, load = ((f"{probed[0]}", f"{probed[1]:.0f} / {probed[2]:.0f}", f"{probed[3]:.0f}") if probed
                             else ("-", "-", "-"))
        timer.reset()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = (time.perf_counter() - start) / args.steps * 1e3
        head = timer.seconds["compute_logits"] / args.steps * 1e3
        layers = (timer.seconds["forward_fused"] + timer.seconds["forward"]) / args.steps * 1e3
        ceiling = weights / rate / 1e6
        rest = step - layers - head
        rows.append({"gb_s": round(rate, 1), "cores": probed,
                     "ceiling_ms": round(ceiling, 3),
                     "step_ms": round(step, 3), "layers_ms": round(layers, 3), "head_ms": round(head, 3),
                     "rest_ms": round(rest, 3), "share": round(ceiling / step, 3)})
        print(f"| {rate:.1f} | {trip} | {loops} | {load} | {ceiling:.2f} | {step:.2f} | {layers:.2f} | {head:.2f} "
              f"| {rest:.2f} | {ceiling / step:.0%} |", flush=True)
    median = statistics.median(r["share"] for r in rows)
    print(f"median share of the ceiling: {median:.0%} ({weights / 1e6:.1f} MB a step)")
    pieces = []
    if engine.runner.fused_stack is not None:
        print(f"\nbefore the timed stretches: core round trip ns, loop us on CPU 0 / 1, DRAM load ns: {cores()}")
        pieces = piece_split(engine, args.steps, args.repeats)
    if args.out:
        args.out.write_text(json.dumps({"host": host, "plan": plan, "rows": rows, "pieces": pieces}, indent=1))


if __name__ == "__main__":
    main()
