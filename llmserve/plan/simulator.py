"""Discrete-event simulation of one replica: FCFS queue, continuous batching, a step-time model.

It follows our scheduler (engine/scheduler.py) step by step: each step, every running decode adds one
token, then prompt chunks fill what is left of the token budget (running prompts first, then waiting
requests in arrival order while fewer than max_num_seqs run). A chunk is at most `chunk` tokens and,
unless it ends the prompt, ends on a KV block boundary; only `max_long_partial_prefills` prompts longer
than a chunk are prefilled at once, and shorter ones pass a long one that waits. A prompt's last chunk
yields its first token in the same step. The step's duration comes from a `StepModel`; requests arriving
during a step wait for the next. Left out: preemption (the planner keeps max_num_seqs within what the KV
memory holds) and the prefix cache (the planner takes cache hits off the traffic instead). What the server
adds outside the steps (its front end, and a slower first step after the engine idled) is `ServerLatency`.

Why a step loop and not a closed formula: TTFT is queueing (Poisson arrivals, service times that depend
on the batch they share), and a step loop is cheap: per step the work is O(prompts being filled), not
O(batch), since decoding requests are only counted and wait in a heap keyed by the step they finish in.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmserve.bench.metrics import percentile
from llmserve.plan.step_model import StepModel, chunk_pairs
from llmserve.plan.traffic import SimRequest


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler's knobs; defaults are `llmserve serve`'s (config.SchedulerConfig)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    chunk: int = 256  # long_prefill_token_threshold: the largest prompt chunk one request runs per step
    max_long_partial_prefills: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.chunk, self.max_long_partial_prefills,
               self.block_size) < 1:
            raise ValueError(f"scheduler limits must be >= 1, got {self}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) > max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): every running decode must fit one step's budget")


@dataclass(frozen=True)
class ServerLatency:
    """What a request waits for outside the step model's steps; both fitted to bench results (fit.py).

    front_end_s: HTTP, chat template and tokenizer before the engine sees a request.
    wake_s: added to the first step after the engine idled at least `idle_s`. A host whose cores idled runs
    slower for a while, a plain matmul loop too, so it is the machine, not the engine
    (docs/performance.md, "Capacity planning"). A closed-loop sweep never idles that long (a client sends its
    next request at once), so the step model fitted to it cannot see this; at light Poisson load most requests find
    the engine idle.
    """

    front_end_s: float = 0.0
    wake_s: float = 0.0
    idle_s: float = 0.2

    def __post_init__(self) -> None:
        if min(self.front_end_s, self.wake_s) < 0 or self.idle_s <= 0:
            raise ValueError(f"server latencies must be >= 0 (idle_s > 0), got {self}")


@dataclass
class SimResult:
    """Per request (in arrival order) and for the run; times in seconds."""

    arrival: list[float]
    ttft: list[float]
    e2e: list[float]
    tpot: list[float | None]  # None for one-token outputs
    output_tokens: list[int]
    steps: int
    busy_s: float  # time with at least one request in the engine
    batch_time: float  # sum over steps of (running requests x step duration)
    max_batch: int
    step_end: list[float]  # when each step ended (step k at step_end[k - 1])
    step_shape: list[tuple[int, int, int]]  # what each step carried: (decode rows, their context, prompt tokens)
    first_step: list[int]  # the step that gave each request its first token
    woken: list[int]  # requests that reached an engine idle for at least ServerLatency.idle_s

    def decode_steps(self, i: int) -> range:
        """Indices (into step_end, step_shape) of request i's decode steps: those after its first token."""
        return range(self.first_step[i], self.first_step[i] + self.output_tokens[i] - 1)

    def gaps(self, i: int) -> list[float]:
        """Request i's inter-token gaps: one per decode step after its first token."""
        return [self.step_end[k] - self.step_end[k - 1] for k in self.decode_steps(i)]

    def summary(self, warmup_fraction: float = 0.0) -> dict[str, Any]:
        """Bench-style figures (ms, req/s, tok/s), leaving out the first `warmup_fraction` of arrivals
        (a run starting empty flatters the queue). Throughput: completed requests over the time from the
        first counted arrival to the last completion, as `llmserve bench` divides."""
        skip = int(len(self.arrival) * warmup_fraction)
        idx = range(skip, len(self.arrival))
        if not idx:
            raise ValueError("no requests left to summarise")
        wall = max(self.arrival[i] + self.e2e[i] for i in idx) - self.arrival[skip]
        out = sum(self.output_tokens[i] for i in idx)
        res: dict[str, Any] = {"num_requests": len(idx), "wall_s": wall,
                               "req_per_s": len(idx) / wall if wall > 0 else None,
                               "output_tok_per_s": out / wall if wall > 0 else None,
                               "mean_batch": self.batch_time / self.busy_s if self.busy_s else 0.0,
                               "max_batch": self.max_batch, "steps": self.steps}
        for name, values in (("ttft", [self.ttft[i] for i in idx]), ("e2e", [self.e2e[i] for i in idx]),
                             ("tpot", [t for i in idx if (t := self.tpot[i]) is not None])):
            res[f"{name}_mean_ms"] = statistics.fmean(values) * 1e3 if values else None
            for p in (50, 90, 99):
                v = percentile(values, p)
                res[f"{name}_p{p}_ms"] = None if v is None else v * 1e3
        return res


def simulate(requests: Sequence[SimRequest], model: StepModel, limits: SchedulerLimits,
             closed_loop: int | None = None, latency: ServerLatency = ServerLatency()) -> SimResult:
    """Run `requests` (sorted by arrival) through one replica until all have finished. With `closed_loop`
    = c, their arrival times are ignored: c clients each send the next request when their previous answer
    has ended (`llmserve bench --concurrency c`). `latency`: what the server adds outside the steps, counted
    in TTFT like the queue."""
    n = len(requests)
    arrival = [r.arrival for r in requests]
    released = n
    if closed_loop is not None:
        if closed_loop < 1:
            raise ValueError(f"closed_loop must be >= 1, got {closed_loop}")
        released = min(closed_loop, n)
        arrival = [0.0] * released + [math.inf] * (n - released)
    ttft = [0.0] * n
    finish = [0.0] * n
    first_step = [0] * n
    step_end: list[float] = []
    step_shape: list[tuple[int, int, int]] = []
    # waiting requests in arrival order, the long prompts apart so that a short one can pass them
    waiting: deque[int] = deque()
    waiting_long: deque[int] = deque()
    filling: list[list[int]] = []  # [request, prompt tokens computed] of admitted prompts, in order
    done_heap: list[tuple[int, int]] = []  # (step whose end is the last token, request)
    num_decoding = 0
    decode_context = 0  # KV tokens the decoding requests attend to in the coming step
    t, step, nxt, remaining = 0.0, 0, 0, n
    front_end_s = latency.front_end_s
    woken: list[int] = []
    wake = 0.0  # added to the coming step: the engine has just woken up
    busy = batch_time = 0.0
    max_batch = 0
    chunk, max_long = limits.chunk, limits.max_long_partial_prefills

    while remaining:
        while nxt < n and arrival[nxt] + front_end_s <= t:
            (waiting_long if requests[nxt].prompt_len > chunk else waiting).append(nxt)
            nxt += 1
        if not num_decoding and not filling and not waiting and not waiting_long:
            idle_from, t = t, arrival[nxt] + front_end_s  # idle until the next arrival
            if t - idle_from >= latency.idle_s:
                woken.append(nxt)
                wake = latency.wake_s
            continue
        budget = limits.max_num_batched_tokens - num_decoding
        prefill_tokens, pairs, long_prefills = 0, 0.0, 0
        for item in filling:  # running prompts, oldest first
            if budget <= 0:
                break
            r, done = item
            long_prefills += requests[r].prompt_len - done > chunk
            k = _chunk(done, requests[r].prompt_len, budget, limits)
            prefill_tokens += k
            pairs += chunk_pairs(done, k)
            budget -= k
            item[1] = done + k
        while budget > 0 and num_decoding + len(filling) < limits.max_num_seqs:
            long_ok = waiting_long and long_prefills < max_long
            if waiting and (not long_ok or waiting[0] < waiting_long[0]):
                r = waiting.popleft()
            elif long_ok:
                r = waiting_long.popleft()
                long_prefills += 1
            else:
                break
            k = _chunk(0, requests[r].prompt_len, budget, limits)
            prefill_tokens += k
            pairs += chunk_pairs(0, k)
            budget -= k
            filling.append([r, k])
        running = num_decoding + len(filling)
        dt = model.step_time(num_decoding, decode_context, prefill_tokens, pairs) + wake
        wake = 0.0
        t += dt
        step += 1
        step_end.append(t)
        step_shape.append((num_decoding, decode_context, prefill_tokens))
        busy += dt
        batch_time += running * dt
        max_batch = max(max_batch, running)
        decode_context += num_decoding  # each decode row appended its token
        while done_heap and done_heap[0][0] == step:
            _, r = heapq.heappop(done_heap)
            finish[r] = t
            num_decoding -= 1
            decode_context -= requests[r].prompt_len + requests[r].output_len
            remaining -= 1
            if released < n:  # closed loop: that client sends its next request
                arrival[released] = t
                released += 1
        kept = []
        for item in filling:
            r, done = item
            if done < requests[r].prompt_len:
                kept.append(item)
                continue
            ttft[r] = t - arrival[r]
            first_step[r] = step
            if requests[r].output_len == 1:
                finish[r] = t
                remaining -= 1
                if released < n:
                    arrival[released] = t
                    released += 1
            else:
                heapq.heappush(done_heap, (step + requests[r].output_len - 1, r))
                num_decoding += 1
                decode_context += requests[r].prompt_len + 1
        filling = kept

    e2e = [finish[i] - arrival[i] for i in range(n)]
    tpot: list[float | None] = [
        (e2e[i] - ttft[i]) / (requests[i].output_len - 1) if requests[i].output_len > 1 else None for i in range(n)]
    return SimResult(arrival, ttft, e2e, tpot, [r.output_len for r in requests], step,
                     busy, batch_time, max_batch, step_end, step_shape, first_step, woken)


def _chunk(done: int, total: int, budget: int, limits: SchedulerLimits) -> int:
    """Prompt tokens a request runs this step: all that remain, or a chunk within the budget and the cap
    that ends on a block boundary (as Scheduler._num_new_tokens)."""
    n = min(total - done, budget, limits.chunk)
    if done + n < total:
        aligned = (done + n) // limits.block_size * limits.block_size - done
        if aligned > 0:
            n = aligned
    return n
