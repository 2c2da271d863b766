"""Continuous batching under one token budget per step, and what a step's results change.

There is no prefill or decode phase. Each step, every scheduled request closes part of the gap
between `num_computed_tokens` and its token count: running requests first (a decode is one token,
an unfinished prompt a chunk), then waiting requests in arrival order while the budget, the
sequence limit and the KV cache allow. Only `max_long_partial_prefills` prompts longer than one
chunk are prefilled at a time; shorter prompts may pass a long one that waits for its turn. When a
running request cannot get a block, the newest running request is preempted: its blocks are freed
and it goes back to the front of the queue to recompute. Nothing is dropped.

`schedule()` says what runs (a `SchedulerOutput`, plain data for the runner); `update_from_output()`
takes the runner's answer and owns everything it changes: computed-token counts, blocks registered in
the prefix cache, new tokens and the stop checks, finished requests' blocks, and the KV tail of
tokens that were run but not kept (rejected speculative tokens).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from llmserve.config import SchedulerConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.step import (
    ModelRunnerOutput,
    NewRequestData,
    RunningRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from llmserve.kv_cache.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int


@dataclass
class RequestUpdate:
    """What one step did to a request: the tokens it gained (and their logprobs), and whether it ended."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs] | None = None  # the whole prompt's, with the first new token


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.requests: dict[str, Request] = {}  # not finished yet (waiting or running), by id
        self._finished_ids: set[str] = set()  # to tell the runner with the next step

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

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
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions)

    def schedule(self, proposals: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """This step's work. `proposals`: speculative tokens to follow some decoding requests' last token
        (the speculator's); each runs with its request, within the budget and max_tokens, and is dropped
        rather than preempting anyone."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.config.max_num_batched_tokens
        long_prefills = 0  # scheduled requests with more than one chunk of prompt left
        proposals = proposals or {}

        # 1. Running requests, oldest first; preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req.num_computed_tokens, req.num_tokens, budget)
            long_prefills += self._is_long(req.num_tokens - req.num_computed_tokens)
            draft = proposals.get(req.request_id, [])[: min(budget - 1, req.max_tokens - req.num_output_tokens - 1)]
            if draft and req.num_computed_tokens == req.num_tokens - 1:
                new_blocks = self.kv_cache.allocate_slots(req.request_id, req.num_tokens + len(draft))
                if new_blocks is not None:
                    out.spec_token_ids[req.request_id] = draft
                    n += len(draft)
            else:
                new_blocks = None
            while new_blocks is None and (
                    new_blocks := self.kv_cache.allocate_slots(req.request_id, req.num_computed_tokens + n)) is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            if new_blocks is not None:
                out.running_requests.append(RunningRequestData(req.request_id, new_blocks, req.num_computed_tokens))
                out.num_scheduled_tokens[req.request_id] = n
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; everything after it already was too

        # 2. Waiting requests in order, while nothing was preempted this step (no room then).
        passed: list[Request] = []  # long prompts that wait for a long prefill to finish
        while self.waiting and budget > 0 and not out.preempted_request_ids:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            hits, num_hit = ([], 0) if req.params.prompt_logprobs is not None else \
                self.kv_cache.get_computed_blocks(req.all_token_ids, req.block_hashes, req.cache_salt)
            if self._is_long(req.num_tokens - num_hit):
                if long_prefills >= self.config.max_long_partial_prefills:
                    passed.append(self.waiting.popleft())
                    continue
                long_prefills += 1
            n = self._num_new_tokens(num_hit, req.num_tokens, budget)
            block_ids = self.kv_cache.allocate_slots(req.request_id, num_hit + n, hits)
            if block_ids is None:
                break
            self.waiting.popleft()
            self.kv_cache.record_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
                req.scheduled_time = time.monotonic()
            if req.status is RequestStatus.PREEMPTED:  # the runner still has its tokens and generator
                out.running_requests.append(RunningRequestData(req.request_id, block_ids, num_hit, resumed=True))
            else:
                out.new_requests.append(NewRequestData(req.request_id, list(req.all_token_ids), req.params,
                                                       block_ids, num_hit))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(passed))  # back in front, in their order
        return out

    def update_from_output(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Apply a step's results; returns an update for every request that gained tokens or finished.

        Requests the runner did not answer for (failed and aborted by the caller) are skipped.
        """
        updates = []
        for request_id, num_scheduled in scheduled.num_scheduled_tokens.items():
            sampled = result.sampled_token_ids.get(request_id)
            req = self.requests.get(request_id)
            if sampled is None or req is None:
                continue
            # speculative tokens run but not kept: their K/V slots are given back
            rejected = len(scheduled.spec_token_ids.get(request_id, ())) - max(len(sampled) - 1, 0)
            req.num_computed_tokens += num_scheduled - rejected
            if rejected:
                self.kv_cache.trim(request_id, req.num_computed_tokens)
            if request_id in result.prompt_logprobs:
                req.prompt_logprobs.extend(result.prompt_logprobs[request_id])
            kept = []
            for token in sampled:
                req.append_token(token)  # detokenizes, checks stops
                kept.append(token)
                if req.status.finished:
                    break
            # blocks full of verified tokens (none past a stop inside an accepted run) join the prefix cache
            self.kv_cache.cache_blocks(request_id, req.all_token_ids, req.block_hashes,
                                       min(req.num_computed_tokens, req.num_tokens), req.cache_salt)
            if not sampled:
                continue  # a prompt chunk that is not the last
            logprobs = result.logprobs.get(request_id)
            prompt = req.prompt_logprobs if req.params.prompt_logprobs is not None and req.num_output_tokens == len(
                kept) else None  # with the first tokens only
            updates.append(RequestUpdate(req, kept, logprobs[: len(kept)] if logprobs is not None else None, prompt))
            if req.status.finished:
                self.finish(req, req.status)
        return updates

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
        if not req.num_output_tokens:
            req.prompt_logprobs.clear()  # the recompute scores the prompt again
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_request_ids.append(req.request_id)  # victims come from the unscheduled tail
