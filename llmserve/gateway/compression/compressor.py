"""The gateway's compression link: one request in, the request to send upstream out, with what was done and why.

The scorer is a model the gateway serves, asked through the gateway's own balancing and retries: one
`/v1/completions` call with `echo: true, logprobs: 0, max_tokens: 1` returns every prompt token's logprob (our
server and vLLM both do this). The context goes as windows of at most `WINDOW_CHARS`, all in one call (one
batch upstream): a window fits any scorer's context length, and a token's score needs little more context than
a window gives. A scorer that fails costs the request nothing but its compression: it goes as it came.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from llmserve.gateway.compression.policy import CompressPolicy, request_policy
from llmserve.gateway.compression.prompt import Refusal, replace, split
from llmserve.gateway.compression.protect import content_words, protected_spans
from llmserve.gateway.compression.select import Token, align, rebuild, select, words
from llmserve.server.errors import APIError

logger = logging.getLogger(__name__)

HEADER = "x-llmserve-compression"  # "rate=0.58 tokens=812->471" | "skipped: <code> (<why>)"
WINDOW_CHARS = 2000  # about 500 tokens of English per scorer window
CHARS_PER_TOKEN = 4  # to skip short prompts without a scorer call

Complete = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]  # (model, completions request) -> its answer


@dataclass(frozen=True)
class Compression:
    """What the link did to one request. `before`/`after`: the context's scorer tokens."""

    body: dict[str, Any]  # the request to send upstream (without `compress`)
    policy: CompressPolicy | None = None
    before: int = 0
    after: int = 0
    refusal: Refusal | None = None

    @property
    def removed(self) -> int:
        return 0 if self.refusal is not None else self.before - self.after

    @property
    def outcome(self) -> str | None:
        """compressed | a refusal's code | None (compression was never asked for)."""
        if self.refusal is not None:
            return self.refusal.code
        return "compressed" if self.policy is not None else None

    def header(self) -> str | None:
        if self.refusal is not None:
            return f"skipped: {self.refusal}".encode("ascii", "replace").decode()
        if self.policy is None:
            return None
        return f"rate={self.after / max(self.before, 1):.2f} tokens={self.before}->{self.after}"


class Compressor:
    def __init__(self, complete: Complete, models: Collection[str]) -> None:
        self.complete = complete
        self.models = models  # the names a request's `compress.scorer` may give

    async def apply(self, route: str, body: dict[str, Any], default: CompressPolicy | None) -> Compression:
        if default is None and "compress" not in body:
            return Compression(body)
        requested = body.get("compress")
        body = {k: v for k, v in body.items() if k != "compress"}  # ours, not the upstream's
        try:
            policy = request_policy(default, requested)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"compress: {e}", param="compress") from None
        if policy is None:
            return Compression(body, refusal=Refusal("disabled", "compress: false") if requested is False else None)
        if policy.scorer is None:
            return Compression(body, policy, refusal=Refusal("no_scorer", "the model has no compress.scorer"))
        if policy.scorer not in self.models:
            raise APIError(400, f"compress.scorer: {policy.scorer!r} is not a model of this gateway",
                           param="compress")
        found = split(route, body, policy.context)
        if isinstance(found, Refusal):
            return Compression(body, policy, refusal=found)
        estimate = sum(len(p.text) for p in found.parts) // CHARS_PER_TOKEN
        if estimate < policy.min_tokens:
            return Compression(body, policy, refusal=_short(f"about {estimate}", policy))
        try:
            scored = await self.score(policy.scorer, [p.text for p in found.parts])
        except (APIError, ValueError, TypeError) as e:  # whatever it answered: the request goes on without it
            logger.warning("compression: the scorer %s failed (%s); the request goes uncompressed", policy.scorer, e)
            return Compression(body, policy, refusal=Refusal("scorer_error", str(e)[:200]))
        anchors = content_words(found.question) if policy.keep_question_words else frozenset()
        units = [words(p.text, tokens, protected_spans(p.text, anchors)) for p, tokens in zip(found.parts, scored,
                                                                                               strict=True)]
        before = sum(w.tokens for ws in units for w in ws)
        if before < policy.min_tokens:
            return Compression(body, policy, before, before, _short(str(before), policy))
        keep, after = select(units, math.floor(policy.rate * before))
        texts = [rebuild(p.text, ws, k) for p, ws, k in zip(found.parts, units, keep, strict=True)]
        return Compression(replace(body, found.parts, texts), policy, before, after)

    async def score(self, model: str, texts: list[str]) -> list[list[Token]]:
        """Each text's tokens with their self-information, from one scorer call over all their windows."""
        windows = [(i, start, end) for i, text in enumerate(texts) for start, end in _windows(text)]
        answer = await self.complete(model, {"prompt": [texts[i][s:e] for i, s, e in windows], "max_tokens": 1,
                                             "echo": True, "logprobs": 0, "temperature": 0})
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != len(windows) or not all(isinstance(c, dict)
                                                                                   for c in choices):
            raise ValueError(f"the scorer answered no choice per window ({len(windows)} windows)")
        out: list[list[Token]] = [[] for _ in texts]
        for (i, start, end), choice in zip(windows, sorted(choices, key=lambda c: c.get("index", 0)), strict=True):
            logprobs = choice.get("logprobs") or {}
            tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
            if not isinstance(tokens, list) or not isinstance(values, list):
                raise ValueError("the scorer gave no prompt logprobs (it must support echo with logprobs)")
            out[i] += [Token(t.start + start, t.end + start, t.info, t.count)
                       for t in align(texts[i][start:end], tokens, values)]
        return out


def _short(tokens: str, policy: CompressPolicy) -> Refusal:
    return Refusal("short", f"{tokens} context tokens < min_tokens {policy.min_tokens}")


def _windows(text: str) -> list[tuple[int, int]]:
    """Spans of at most WINDOW_CHARS, cut before the last whitespace in a window's second half (a paragraph
    break if there is one), so a window starts as the text's own tokens do."""
    spans, start = [], 0
    while len(text) - start > WINDOW_CHARS:
        window = text[start:start + WINDOW_CHARS]
        half = WINDOW_CHARS // 2
        cut = window.rfind("\n\n", half)
        if cut < 0:
            cut = max(window.rfind(" ", half), window.rfind("\n", half))
        cut = start + (cut if cut > 0 else WINDOW_CHARS)
        spans.append((start, cut))
        start = cut
    if start < len(text) or not spans:
        spans.append((start, len(text)))
    return spans

