"""Perplexity over a long text with a sliding window: every token scored once, with up to `window - stride`
tokens of context before the stretch it scores (Hugging Face's recipe), token-weighted over the text.

Windows are independent requests, so a server or the engine runs them as one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, nats
    tokens: int  # tokens scored
    windows: int
    window: int
    stride: int


def windows(token_ids: list[int], window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) per window: [begin, end) is sent, tokens from `first scored` on are
    counted. The first window scores all but its first token; each later one the `stride` tokens after
    the previous window's end (or fewer, at the end of the text)."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window], got stride {stride}, window {window}")
    out, prev_end = [], 0
    for begin in range(0, len(token_ids), stride):
        end = min(begin + window, len(token_ids))
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == len(token_ids):
            break
    return out


def perplexity(target, token_ids: list[int], window: int = 512, stride: int = 256) -> Perplexity:
    """`target`: an evaluate.targets target (token_logprobs of token sequences)."""
    spans = windows(token_ids, window, stride)
    scored = target.token_logprobs([token_ids[b:e] for b, e, _ in spans])
    nll, count = 0.0, 0
    for (begin, _, first), lps in zip(spans, scored, strict=True):
        for lp in lps[first - begin :]:
            nll -= lp
            count += 1
    mean = nll / count
    return Perplexity(math.exp(mean), mean, count, len(spans), window, stride)
