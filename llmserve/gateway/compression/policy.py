"""How a model's prompts are compressed: the YAML policy (`models: {NAME: {compress: {...}}}`) and the per-request
override (the body's `compress`: false, true, or a mapping of these same fields)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

# what may be compressed: the material before the question in the last user message (a pasted or retrieved
# document), earlier user and assistant turns, and system / developer messages (the operator's instructions)
CONTEXTS = ("documents", "turns", "system")


@dataclass(frozen=True)
class CompressPolicy:
    scorer: str | None = None  # a model of `models:` (a small causal LM) that scores each token's self-information
    rate: float = 0.6  # keep at most this share of the context's tokens (the question and protected spans count)
    min_tokens: int = 400  # a context shorter than this (scorer tokens) is sent as it is: not worth a scorer call
    keep_question_words: bool = True  # keep the question's content words wherever the context has them
    # instructions are never compressed unless named: a dropped "not" in a system prompt changes the rule
    context: tuple[str, ...] = ("documents", "turns")

    def __post_init__(self) -> None:
        if isinstance(self.rate, bool) or not isinstance(self.rate, int | float) or not 0.0 < self.rate <= 1.0:
            raise ValueError(f"rate must be a number in (0, 1], not {self.rate!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, not {self.min_tokens!r}")
        if self.scorer is not None and not isinstance(self.scorer, str):
            raise ValueError("scorer must be a model name")
        if not isinstance(self.keep_question_words, bool):
            raise ValueError("keep_question_words must be true or false")
        context = (self.context,) if isinstance(self.context, str) else self.context
        if not isinstance(context, list | tuple) or not context or not set(context) <= set(CONTEXTS):
            raise ValueError(f"context must name some of {', '.join(CONTEXTS)}, not {self.context!r}")
        object.__setattr__(self, "context", tuple(context))  # a YAML or JSON list

    @classmethod
    def from_config(cls, raw: dict[str, Any], where: str) -> CompressPolicy:
        try:
            return cls(**_known(raw))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def request_policy(default: CompressPolicy | None, requested: Any) -> CompressPolicy | None:
    """The policy for one request: the model's, changed by the body's `compress` (absent: the model's; false: none;
    true: the model's, or the defaults; a mapping: its fields over the model's). ValueError when malformed."""
    if requested is None:
        return default
    if requested is False:
        return None
    if requested is True:
        return default or CompressPolicy()
    if not isinstance(requested, dict):
        raise ValueError("expected false, true or an object such as {\"rate\": 0.5}")
    return replace(default or CompressPolicy(), **_known(requested))


def _known(raw: dict[str, Any]) -> dict[str, Any]:
    unknown = set(raw) - {f.name for f in fields(CompressPolicy)}
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(sorted(unknown))}")
    return dict(raw)
