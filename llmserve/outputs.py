"""Results handed back to callers, shaped like vLLM's so code written for it reads ours.

The engine's outputs are deltas: each holds the tokens, text and logprobs a request gained since its
last output (its last one is `finished`). `RequestOutput.add` folds deltas into the whole result, as the
offline `LLM` and a non-streaming server response do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per generated token (None: not asked for)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # set when this request failed inside the engine (finished is then True): finish_reason "error" when its output
    # constraint failed while decoding, "abort" when an engine step failed on it
    error: str | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which has no
    # context), in the first output that carries tokens
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold a later delta of the same request in: text, tokens and logprobs appended, the rest replaced."""
        for mine, new in zip(self.outputs, delta.outputs, strict=True):
            mine.text += new.text
            mine.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + new.logprobs
            mine.cumulative_logprob = new.cumulative_logprob
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.finished, self.metrics, self.error = delta.finished, delta.metrics, delta.error
        self.num_cached_tokens = delta.num_cached_tokens
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
