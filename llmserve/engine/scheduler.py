"""Continuous batching under one token budget per step.

There is no prefill or decode phase. Each step, every scheduled request closes part of the gap
between `num_computed_tokens` and its token count: running requests first (a decode is one token,
an unfinished prompt a chunk), then waiting requests in arrival order while the budget, the
sequence limit and the KV cache allow. Only `max_long_partial_prefills` prompts longer than one
chunk are prefilled at a time; shorter prompts may pass a long one that waits for its turn. When a
running request cannot get a block, the newest running request is preempted: its blocks are freed
and it goes back to the front of the queue to recompute. Nothing is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.config import SchedulerConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.kv_cache.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerOutput:
    # (request, number of tokens to run now), running requests first
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted) and give its blocks back."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        long_prefills = 0  # scheduled requests with more than one chunk of prompt left

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req.num_computed_tokens, req.num_tokens, budget)
            long_prefills += self._is_long(req.num_tokens - req.num_computed_tokens)
            while not self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; everything after it already was too

        # 2. Waiting requests in order, while nothing was preempted this step (no room then).
        passed: list[Request] = []  # long prompts that wait for a long prefill to finish
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            hits, num_hit = self.kv_cache.get_computed_blocks(req.all_token_ids, req.block_hashes, req.cache_salt)
            if self._is_long(req.num_tokens - num_hit):
                if long_prefills >= self.config.max_long_partial_prefills:
                    passed.append(self.waiting.popleft())
                    continue
                long_prefills += 1
            n = self._num_new_tokens(num_hit, req.num_tokens, budget)
            if not self.kv_cache.allocate_slots(req.request_id, num_hit + n, hits):
                break
            self.waiting.popleft()
            self.kv_cache.record_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))  # back in front, in their order
        return out

    def _is_long(self, num_uncomputed: int) -> bool:
        return num_uncomputed > self.config.long_prefill_token_threshold

    def _num_new_tokens(self, num_computed: int, num_tokens: int, budget: int) -> int:
        """Tokens to run now: all that remain, or a chunk within the budget and the long-prefill cap.

        A chunk that does not finish the sequence ends on a block boundary, so a prompt is computed
        in the same block-aligned pieces whether or not a cached prefix covered its start.
        """
        n = min(num_tokens - num_computed, budget, self.config.long_prefill_token_threshold)
        if num_computed + n < num_tokens:
            bs = self.kv_cache.block_size
            aligned = (num_computed + n) // bs * bs - num_computed
            if aligned > 0:
                n = aligned
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)  # victims come from the unscheduled tail, never from out.scheduled
