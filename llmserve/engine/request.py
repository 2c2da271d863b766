"""A request's whole state inside the engine.

Prompt and output tokens live in one list; `num_computed_tokens` says how much of it already has
K/V in the cache. The scheduler only ever closes that gap — a prompt chunk, a decode token or a
recompute after preemption are the same operation.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.sampling_params import SamplingParams
from llmserve.structured_output.manager import constraint_failure

if TYPE_CHECKING:
    from llguidance import LLMatcher

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its output constraint failed while decoding (`Request.error` says why)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: list[int],
        detokenizer: IncrementalDetokenizer,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.detokenizer = detokenizer
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache, once admitted
        self.cache_salt = cache_salt  # requests with different salts never share KV blocks
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0  # of the sampled tokens, when logprobs were asked for
        self.prompt_logprobs: list = []  # TokenLogprobs of prompt tokens 1.., as steps score them
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None  # first admitted to the running batch (queue time ends)
        self.first_token_time: float | None = None
        self.grammar: LLMatcher | None = None  # a constrained request's matcher, advanced token by token
        self.error: str | None = None  # why it ended with FINISHED_ERROR

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        """Record a sampled token, detokenize it and decide whether the request is done."""
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        n = self.num_output_tokens
        if self.grammar is not None and not self._advance_grammar(token_id):
            self.detokenizer.finish()
            self.status = RequestStatus.FINISHED_ERROR
            return
        is_eos = token_id in self.eos_token_ids and not self.params.ignore_eos
        is_stop_id = token_id in self.params.stop_token_ids
        if (is_eos or is_stop_id) and n > self.params.min_tokens:
            self.detokenizer.finish()
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = None if is_eos else token_id
            return
        grammar_complete = self.grammar is not None and self.grammar.is_stopped()
        stop_str = self.detokenizer.append(token_id, check_stop=n > self.params.min_tokens)
        if stop_str is not None:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = stop_str
        elif grammar_complete:  # nothing but EOS could follow: stop now rather than spend a step on it
            self.detokenizer.finish()
            self.status = RequestStatus.FINISHED_STOPPED
        elif n >= self.max_tokens:
            self.detokenizer.finish()
            self.status = RequestStatus.FINISHED_LENGTH

    def _advance_grammar(self, token_id: int) -> bool:
        """Feed the grammar a token (EOS included: it ends a complete output); False when the grammar refused it
        or failed on it (a limit of the grammar library reached mid-output). The request then ends with that
        error, never as a stop with text the constraint did not accept."""
        if self.grammar.consume_token(token_id) and not self.grammar.is_error():
            return True
        self.error = f"the output constraint failed while decoding: {constraint_failure(self.grammar)}"
        logger.warning("request %s: %s (token %d)", self.request_id, self.error, token_id)
        return False
