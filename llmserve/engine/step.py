"""What one engine step passes between its parts: scheduler ▶ model runner ▶ scheduler.

Plain data, no live objects: the runner never sees a `Request`, a detokenizer or the KV manager, so it
could run in another process (a parallel worker) from these messages alone. The scheduler says
what changed since the last step (new requests, new blocks, finished ids) and how many tokens each
request runs now; the runner keeps its own copy of each request's tokens, blocks and random generator,
and answers with the tokens it sampled, a list per request (one token, or several once speculative
tokens are verified, or none for a prompt chunk that does not end its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen yet: everything it keeps about it."""

    request_id: str
    token_ids: list[int]  # the prompt (the runner appends what it samples)
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # > 0 when a cached prefix covers the start


@dataclass
class RunningRequestData:
    """A request the runner knows: what changed since it last ran."""

    request_id: str
    # appended to its block table, cut to the blocks its computed tokens fill (those past them held rejected
    # proposals: given back); if resumed, the whole new table
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False  # back from preemption: its blocks were freed, `new_block_ids` replace them


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    running_requests: list[RunningRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # tokens each request runs now
    # proposed tokens that follow a request's last token, run in this step and verified (none yet)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_request_ids: set[str] = field(default_factory=set)  # finished or aborted since the last step
    preempted_request_ids: list[str] = field(default_factory=list)  # their blocks went back this step
    # constrained requests that sample: int32 bitmasks of the allowed tokens [1 + proposal tokens, ceil(V / 32)]
    grammar_bitmasks: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def restricted_to(self, request_ids: list[str]) -> SchedulerOutput:
        """The same step for some of its requests only (the state changes stay with the whole step's)."""
        return SchedulerOutput(num_scheduled_tokens={r: self.num_scheduled_tokens[r] for r in request_ids},
                               spec_token_ids={r: t for r, t in self.spec_token_ids.items() if r in request_ids},
                               grammar_bitmasks={r: m for r, m in self.grammar_bitmasks.items() if r in request_ids})


@dataclass
class TokenLogprobs:
    """A sampled token's log-probability in the model's distribution, its rank, and the top ones."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), best first, as many as asked for


@dataclass
class ModelRunnerOutput:
    # per request that ran: the tokens it sampled ([] for a prompt chunk that does not end its prompt)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # per request that asked for logprobs: one entry per sampled token
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # per request that asked for prompt logprobs: one entry per prompt token this step scored (the token at
    # each position after the first, given those before it)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

    def merge(self, other: ModelRunnerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput({**self.sampled_token_ids, **other.sampled_token_ids},
                                 {**self.logprobs, **other.logprobs},
                                 {**self.prompt_logprobs, **other.prompt_logprobs})
