#!/usr/bin/env python3
"""Tensor parallelism on this CPU: two ranks of one thread each against one rank of all the threads.

    .venv/bin/python benchmarks/tensor_parallel.py                               # qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/tensor_parallel.py --model qwen2.5-coder-1.5b

1. The collective alone (after the engines, at the model's hidden size): a gloo all-reduce of a
   [tokens, hidden] bf16 tensor between two processes (what each of the 2 x layers all-reduces of a step
   costs), median of repeated calls, per size.
2. The engine, per configuration (tensor_parallel_size 1 and 2, everything else default; the model's
   default quantization): decode output tok/s at batch 1 and 8 (greedy, 64 tokens after short prompts),
   the time to the first token of one 512-token prompt, the share of the generate time rank 0 spent inside
   the collectives (it includes waiting for the slower rank), and each process's resident memory.
Writes benchmarks/results/tensor_parallel.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.distributed.tensor_parallel import TensorParallel  # noqa: E402
from llmserve.evaluate.datasets import perplexity_text  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def _all_reduce_rank(rank: int, port: int, hidden: int, sizes: list[int], repeats: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    medians = {}
    for tokens in sizes:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            group.allreduce([x]).wait()
            times.append(time.perf_counter() - start)
        medians[tokens] = statistics.median(times)
    out.put((rank, medians))


def all_reduce_times(hidden: int, sizes: list[int], repeats: int = 300) -> dict[int, float]:
    """Median seconds of one all-reduce of [tokens, hidden] bf16 between two one-thread processes."""
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=_all_reduce_rank, args=(r, store.port, hidden, sizes, repeats, out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return {tokens: max(results[0][tokens], results[1][tokens]) for tokens in sizes}


class CollectiveClock:
    """Seconds rank 0 spends inside TensorParallel's collectives (patched on the class, in this process)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._saved = {}
        for name in ("all_reduce", "all_gather_columns"):
            original = getattr(TensorParallel, name)
            self._saved[name] = original

            def timed(tp, x, _original=original):
                start = time.perf_counter()
                try:
                    return _original(tp, x)
                finally:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1

            setattr(TensorParallel, name, timed)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def measure(model: str, tp: int, clock: CollectiveClock) -> dict:
    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_gb=1.0, max_model_len=2048)
    load_s = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    rss = {"rank 0": psutil.Process(os.getpid()).memory_info().rss / 2**30}
    if tp > 1:
        for i, worker in enumerate(llm.engine.runner._workers, start=1):
            rss[f"rank {i}"] = psutil.Process(worker.pid).memory_info().rss / 2**30
    text = perplexity_text()
    long_prompt = tokenizer.encode(text)[:512]
    short = [tokenizer.encode(f"Question {i}: {text[i * 200:(i * 200) + 300]}")[:48] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(short[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
    row = {"tensor_parallel_size": tp, "load_s": load_s, "rss_gib": rss, "threads_per_rank": None,
           "hidden_size": llm.engine.model_config.hidden_size}
    for batch in (1, 8):
        clock.reset()
        start = time.perf_counter()
        outs = llm.generate(short[:batch], greedy, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        row[f"decode_b{batch}_tok_s"] = tokens / seconds
        row[f"decode_b{batch}_collective_share"] = clock.seconds / seconds if tp > 1 else 0.0
        row[f"decode_b{batch}_collective_calls"] = clock.calls
    clock.reset()
    start = time.perf_counter()
    llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    row["prefill_512_s"] = time.perf_counter() - start
    row["prefill_collective_share"] = clock.seconds / row["prefill_512_s"] if tp > 1 else 0.0
    row["threads_per_rank"] = torch.get_num_threads()
    llm.shutdown()
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--out", type=Path, default=RESULTS / "tensor_parallel.json")
    args = ap.parse_args()
    clock = CollectiveClock()
    rows = [measure(args.model, tp, clock) for tp in (1, 2)]
    print("all-reduce alone ...", flush=True)
    reduce = all_reduce_times(rows[0]["hidden_size"], [1, 8, 64, 512])
    print({k: f"{v * 1e6:.0f} us" for k, v in reduce.items()}, flush=True)
    result = {"model": args.model, "host": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "all_reduce_s": reduce, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))
    lines = [f"# Tensor parallelism, {args.model}, {os.cpu_count()} CPUs", "",
             "| all-reduce [tokens, hidden] bf16 | 1 | 8 | 64 | 512 |", "|---|---:|---:|---:|---:|",
             "| median (us) | " + " | ".join(f"{reduce[t] * 1e6:.0f}" for t in (1, 8, 64, 512)) + " |", "",
             "| ranks | threads/rank | decode b1 tok/s | decode b8 tok/s | prefill 512 s | collectives b1 / b8 / "
             "prefill | RSS GiB per rank |", "|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['tensor_parallel_size']} | {r['threads_per_rank']} | {r['decode_b1_tok_s']:.1f} | "
                     f"{r['decode_b8_tok_s']:.1f} | {r['prefill_512_s']:.2f} | "
                     f"{r['decode_b1_collective_share']:.0%} / {r['decode_b8_collective_share']:.0%} / "
                     f"{r['prefill_collective_share']:.0%} | "
                     + ", ".join(f"{v:.2f}" for v in r["rss_gib"].values()) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
