"""Speculative decoding's one seam in the engine: which requests get proposals this step, and how many.

Before each step the engine asks for proposals for the running requests that are decoding; the
scheduler budgets them like any other tokens, the runner verifies them in the same forward pass
(rejection_sampler.py), and the scheduler rolls back the KV slots of the rejected ones. After the step
the speculator learns from the outcome: each request's acceptance rate and what a step costs.

Only where it pays. A proposal token costs the target one more token in the step whether or not it is
kept; whether that pays depends on the host (a step's cost per extra token: large on a compute-bound
CPU, next to nothing where weights stream from memory; docs/performance.md, "Speculative decoding") and on
the batch (at 32 running requests a step is already compute-bound). So the speculator fits the cost of a
decode-only step as a line in its token count, from the steps it times, and per request keeps a running
estimate `a` of how often a proposed token is kept. A request's j-th proposal token yields a^j tokens in
expectation; tokens are added, best first, while the expected tokens per second of the step rise, and a
request or a whole step with none worth it runs without. Proposing costs too: a draft model runs one step
of its own per proposal depth (whatever the number of requests at that depth), so the first token a step
takes at a new depth also pays the measured cost of a depth (n-gram lookup: next to nothing); what a
proposer spends once per request (a draft's prefill of a new prompt) is not a depth's cost. Every estimate
drifts back toward trying while it goes unused, so one bad measurement never switches speculation off
for good. vLLM's `disable_by_batch_size` is kept as a hard limit on top.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from llmserve.config import SpeculativeConfig
from llmserve.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:  # the engine's types, for annotations only: the engine imports this module
    from llmserve.engine.request import Request
    from llmserve.engine.step import ModelRunnerOutput, SchedulerOutput

# Acceptance estimate of a request with no history (3 of 4 proposal tokens kept): optimistic enough to try (a
# first proposal only happens where the proposer found a match); it decays with the request's outcomes.
PRIOR_ACCEPTED, PRIOR_TRIALS = 3.0, 4.0
DECAY = 0.8  # weight of a request's older outcomes per step
RECOVERY = 0.95  # ... and per step it runs without proposals
# Until steps of two different sizes were timed: an extra token costs this fraction of a 1-token step
PRIOR_COST_PER_TOKEN = 0.5


class Proposer(Protocol):
    """Where proposal tokens come from (prompt lookup, a draft model): one batched call a step."""

    # seconds of the last propose() spent on work a request needs once, not per proposal depth (a draft
    # model's prefill of a prompt it has not seen): left out of the cost of a depth
    catch_up_seconds: float
    # True where a request's first proposal costs that catch-up (a draft model's cache of its tokens)
    catches_up: bool

    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> dict[str, list[int]]:
        """Up to num_tokens[id] tokens to follow each request's tokens; requests without any left out."""
        ...


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications (request-steps that carried proposal tokens)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields, the target's own included (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class StepCost:
    """Seconds of a decode-only step as a function of its token count: a line through the running means
    of the sizes seen (least squares), with a prior slope until two sizes were seen."""

    def __init__(self) -> None:
        self._mean: dict[int, float] = {}  # token count -> running mean seconds

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self._mean.get(num_tokens)
        self._mean[num_tokens] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def line(self) -> tuple[float, float] | None:
        """(intercept, seconds per token), or None before any step was timed."""
        if not self._mean:
            return None
        xs, ys = list(self._mean), list(self._mean.values())
        if len(xs) == 1:
            per_step = ys[0] / (1 + PRIOR_COST_PER_TOKEN * (xs[0] - 1))
            return per_step * (1 - PRIOR_COST_PER_TOKEN), per_step * PRIOR_COST_PER_TOKEN
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.01 * min(ys))  # never free
        return max(my - slope * mx, 0.0), slope


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        """`proposer`: the draft model's (built by the engine, which owns engines); n-gram by default."""
        self.config = config
        self.proposer = proposer or NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                                  config.prompt_lookup_max)
        self.reset()

    def reset(self) -> None:
        """Start from what nothing has taught yet. The engine calls it after its own requests (calibration, the
        compile warm-up): their steps include compiling each new shape (a warm-up step can take a minute), and a
        size's running mean keeps such a time until that size runs again, which at c=1 it never does: with
        `--compile`, a served c=1 stream would get no proposal at all."""
        self.cost = StepCost()
        self.depth_cost = 0.0  # seconds the proposer takes per proposal depth (a running mean)
        self.stats = SpecDecodeStats()
        # per request: decayed kept proposal tokens, and proposal tokens tried up to a rejection (from the prior)
        self._accepted: dict[str, float] = {}
        self._trials: dict[str, float] = {}
        # A catching-up proposer (a draft model) never starts on a request that decoded while the batch-size limit
        # held proposals off (`_late`): alone again, it would first prefill the request's whole context into the
        # draft, for a stretch alone that the next arrival ends (slower than no speculation at c=2;
        # docs/performance.md, "Speculative decoding"). Requests it has started on go on.
        self._started: set[str] = set()
        self._late: set[str] = set()

    def acceptance(self, request_id: str) -> float:
        return self._accepted.get(request_id, PRIOR_ACCEPTED) / self._trials.get(request_id, PRIOR_TRIALS)

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposal tokens for the decoding requests worth it this step (most get none under load)."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1
                    and not (r.params.seed is not None and not r.params.greedy)  # its text must not depend on load
                    and not (self.proposer.catches_up and r.request_id in self._late)]
        limit = self.config.disable_by_batch_size
        if not decoding:
            return {}
        if limit is not None and len(running) >= limit:
            if self.proposer.catches_up:
                self._late.update(r.request_id for r in decoding if r.request_id not in self._started)
            return {}
        k = self.config.num_speculative_tokens
        room = {r.request_id: n for r in decoding if (n := min(k, r.max_tokens - r.num_output_tokens - 1)) > 0}
        wanted = room if not self.config.adaptive else self._worth_it(room, len(running))
        for r in decoding:
            if r.request_id not in wanted:
                self._forget(r.request_id)
        if not wanted:
            self.depth_cost *= RECOVERY  # unmeasured while unused: drift toward trying again
            return {}
        if self.proposer.catches_up:
            self._started.update(wanted)
        start = time.perf_counter()
        proposals = self.proposer.propose([r for r in decoding if r.request_id in wanted], wanted)
        seconds = time.perf_counter() - start - self.proposer.catch_up_seconds
        per_depth = max(seconds, 0.0) / max(wanted.values())
        self.depth_cost = per_depth if not self.depth_cost else 0.8 * self.depth_cost + 0.2 * per_depth
        return proposals

    def _worth_it(self, room: dict[str, int], batch_size: int) -> dict[str, int]:
        """How many proposal tokens each request should carry: tokens are added, best expected yield first
        (a request's j-th yields a^j), while the step's expected tokens per second rise."""
        line = self.cost.line()
        if line is None or not room:
            return {}  # the first step is timed plain
        intercept, per_token = line
        # running requests that are not decoding run prompt chunks: part of the step, counted as one token
        tokens, seconds = float(batch_size), intercept + per_token * batch_size
        rates = {rid: self.acceptance(rid) for rid in room}
        heap = [(-rates[rid], rid, 1) for rid in room]
        heapq.heapify(heap)
        take: dict[str, int] = {}
        depth = 0
        while heap:
            neg_gain, rid, j = heapq.heappop(heap)
            gain = -neg_gain
            cost = per_token + (self.depth_cost if j > depth else 0.0)
            if gain * seconds <= cost * tokens:  # (tokens + gain) / (seconds + cost) <= tokens / seconds
                continue  # a cheaper token at a depth already paid for may still be worth it
            tokens, seconds, depth = tokens + gain, seconds + cost, max(depth, j)
            take[rid] = j
            if j < room[rid]:
                heapq.heappush(heap, (-gain * rates[rid], rid, j + 1))
        return take

    def _forget(self, request_id: str) -> None:
        """A step without proposals moves the request's estimate back toward the prior, so a request that
        stopped speculating after a bad stretch tries again later (output changes character)."""
        if request_id in self._trials:
            self._accepted[request_id] = RECOVERY * self._accepted[request_id] + (1 - RECOVERY) * PRIOR_ACCEPTED
            self._trials[request_id] = RECOVERY * self._trials[request_id] + (1 - RECOVERY) * PRIOR_TRIALS

    def observe(self, scheduled: SchedulerOutput, result: ModelRunnerOutput, seconds: float) -> None:
        """Learn from a step's outcome: acceptance per request, the step's cost, the counters."""
        for request_id in scheduled.finished_request_ids:
            self._accepted.pop(request_id, None)
            self._trials.pop(request_id, None)
            self._started.discard(request_id)
            self._late.discard(request_id)
        decode_only = True
        for request_id, num_scheduled in scheduled.num_scheduled_tokens.items():
            draft = scheduled.spec_token_ids.get(request_id, ())
            decode_only &= num_scheduled == len(draft) + 1
            sampled = result.sampled_token_ids.get(request_id)
            if not draft or not sampled:
                continue
            accepted = len(sampled) - 1
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(draft)
            self.stats.num_accepted_tokens += accepted
            self._accepted[request_id] = DECAY * self._accepted.get(request_id, PRIOR_ACCEPTED) + accepted
            self._trials[request_id] = (DECAY * self._trials.get(request_id, PRIOR_TRIALS) + accepted
                                        + (accepted < len(draft)))
        if decode_only and scheduled.num_scheduled_tokens:
            self.cost.observe(scheduled.total_num_scheduled_tokens, seconds)
