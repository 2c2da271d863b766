"""Draft-model proposals: a smaller model of the same vocabulary, run by our own engine, guesses the next
tokens greedily.

The draft is a whole `LLMEngine` of its own (its model, its paged KV cache, its scheduler): each step,
every request that speculates becomes a draft request over its current tokens, and the draft engine runs
them together until each has its proposals. Its prefix cache holds every full block a request's earlier
proposals computed, so a request catches up only on its last partial block and the tokens verified since.
A request's first proposal makes the draft prefill its whole prompt: that time is reported as catch-up
(`catch_up_seconds`), paid once per request, not by each proposal depth the speculator weighs.
Greedy proposals are deterministic, so the rejection sampler verifies them as it does n-gram ones (one-hot
q): the target's distribution is kept exactly, at any temperature.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Protocol

from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's types, for annotations only: the engine builds this proposer
    from llmserve.engine.request import Request

logger = logging.getLogger(__name__)
# A draft request that finds fewer of its tokens in the draft's prefix cache than this is catching up on a
# prompt, not on the last partial block and the few tokens verified since its previous proposal.
CATCH_UP_TOKENS = 32


class DraftEngine(Protocol):
    """What the proposer needs of an `LLMEngine`."""

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams | None = None) -> Request: ...

    def step(self) -> list: ...

    def has_unfinished_requests(self) -> bool: ...


class DraftModelProposer:
    catches_up = True  # a request's first proposal prefills its tokens into the draft's cache

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()
        self.catch_up_seconds = 0.0

    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> dict[str, list[int]]:
        """Up to num_tokens[id] greedy draft tokens after each request's tokens (none for a request the
        draft cannot take: longer than its context or cache)."""
        ids, added = {}, []
        for r in requests:
            draft_id = f"draft-{next(self._ids)}"
            params = SamplingParams(temperature=0, max_tokens=num_tokens[r.request_id], ignore_eos=True)
            try:
                added.append(self.engine.add_request(draft_id, list(r.all_token_ids), params))
            except ValueError as e:
                logger.debug("no draft for %s: %s", r.request_id, e)
                continue
            ids[draft_id] = r.request_id
        drafts: dict[str, list[int]] = {rid: [] for rid in ids.values()}
        self.catch_up_seconds = 0.0
        first_tokens = False  # until every draft request has its first token, steps may be catching up
        while self.engine.has_unfinished_requests():
            start = time.perf_counter()
            for out in self.engine.step():
                drafts[ids[out.request_id]].extend(out.outputs[0].token_ids)
            if not first_tokens:
                if any(d.num_prompt_tokens - (d.num_cached_tokens or 0) > CATCH_UP_TOKENS for d in added):
                    self.catch_up_seconds += time.perf_counter() - start
                first_tokens = all(drafts.values())
        return {rid: tokens for rid, tokens in drafts.items() if tokens}
