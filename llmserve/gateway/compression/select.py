"""From scored tokens to the text that is kept: Selective Context's lexical units under LLMLingua's token budget.

A token's self-information is -log p(token | what precedes it) under a small causal LM: what the LM could have
guessed, the target model can too. Tokens are grouped into words (a word starts at whitespace), since half a
word confuses a model more than a missing one. Words compete by their mean self-information per token (the
information a kept token buys, as in a knapsack by density) and the least informative go first, until the
kept tokens fit `rate` x the context's tokens. Protected words, whitespace (the layout) and the unscored first
token of each scorer window are always kept; when they alone exceed the budget, the budget is missed and the
achieved rate says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmserve.gateway.compression.protect import Spans

_PARTIAL = "\ufffd"  # a token that is part of one character decodes alone to U+FFFD


@dataclass(frozen=True)
class Token:
    start: int  # a span of the scored text
    end: int
    info: float  # self-information in nats (-logprob); inf: unscored
    count: int = 1  # scorer tokens in this span (a character split over byte tokens is one span)


@dataclass(frozen=True)
class Word:
    start: int
    end: int
    tokens: int
    info: float  # summed self-information of its tokens
    keep: bool  # protected, whitespace, or unscored: never dropped

    @property
    def density(self) -> float:
        return self.info / self.tokens


def align(text: str, tokens: list[str], logprobs: list[float | None]) -> list[Token]:
    """The scorer's prompt tokens as spans of `text`, from the token strings alone (servers' `text_offset` drift
    over multi-byte characters). Tokens after the text (the one generated) are left out. ValueError when the
    tokens do not spell the text (a tokenizer that normalises it): then it cannot be compressed safely."""
    out: list[Token] = []
    at, pending = 0, []  # pending: self-information of a run of partial-character tokens
    for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        info = math.inf if logprob is None else -float(logprob)
        if at >= len(text) and not pending:
            break
        if i == 0 and logprob is None and not text.startswith(token):
            continue  # a BOS token the server echoes by name
        if _PARTIAL in token and not text.startswith(token, at):
            pending.append(info)
            continue
        if pending:
            end = text.find(token, at) if token else at
            if end <= at:
                raise ValueError(f"scorer tokens do not spell the text near character {at}")
            out.append(Token(at, end, sum(pending), len(pending)))
            at, pending = end, []
        if not text.startswith(token, at):
            raise ValueError(f"scorer token {token!r} does not match the text at character {at}")
        out.append(Token(at, at + len(token), info))
        at += len(token)
    if pending:
        out.append(Token(at, len(text), sum(pending), len(pending)))
        at = len(text)
    if at != len(text):
        raise ValueError(f"scorer tokens cover {at} of {len(text)} characters")
    return out


def words(text: str, tokens: list[Token], protected: Spans) -> list[Word]:
    """Tokens grouped into words: a word starts at a token that starts with whitespace or follows one that
    ends with it; whitespace-only tokens are words of their own, always kept."""
    out: list[Word] = []
    group: list[Token] = []

    def close() -> None:
        if group:
            start, end = group[0].start, group[-1].end
            info = sum(t.info for t in group)
            keep = text[start:end].isspace() or math.isinf(info) or protected.overlaps(start, end)
            out.append(Word(start, end, sum(t.count for t in group), info, keep))
            group.clear()

    for token in tokens:
        piece = text[token.start:token.end]
        if group and (piece[:1].isspace() or text[group[-1].end - 1].isspace()):
            close()
        group.append(token)
    close()
    return out


def select(texts: list[list[Word]], budget: int) -> tuple[list[list[bool]], int]:
    """Which words to keep, over all texts together (one budget: a redundant document gives more), and the
    tokens kept. Drops the least informative unprotected words until at most `budget` tokens are kept."""
    kept = sum(w.tokens for ws in texts for w in ws)
    flags = [[True] * len(ws) for ws in texts]
    candidates = sorted((w.density, i, j) for i, ws in enumerate(texts) for j, w in enumerate(ws) if not w.keep)
    for _, i, j in candidates:
        if kept <= budget:
            break
        flags[i][j] = False
        kept -= texts[i][j].tokens
    return flags, kept


def rebuild(text: str, words: list[Word], keep: list[bool]) -> str:
    return "".join(text[w.start:w.end] for w, k in zip(words, keep, strict=True) if k)
