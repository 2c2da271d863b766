"""Prompt-lookup proposals: the tokens that followed the last time the sequence's current ending appeared.

Output that repeats its input (an edited file, a quoted document, a refactored function) is full of
n-grams seen before; after the longest recent match of the sequence's last `max_n` (down to `min_n`)
tokens, the tokens that came next are a free guess at what comes now. No model runs: a proposal costs a
scan of the request's own tokens, and a sequence without such a match proposes nothing.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], num_tokens: int | None = None) -> list[int]:
        """Up to `num_tokens` (default: the configured number) tokens to follow `token_ids`."""
        k = self.num_tokens if num_tokens is None else num_tokens
        if k < 1 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        # candidate ends of an earlier match: positions before the last holding the last token
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if len(ends) == 0:
            return []
        lengths = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for m in range(1, min(self.max_n, last)):
            back = ends - m
            alive &= back >= 0
            alive[alive] = tokens[back[alive]] == tokens[last - m]
            if not alive.any():
                break
            lengths += alive
        best = lengths.max()
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(lengths == best)[-1]])  # the most recent of the longest matches
        return tokens[end + 1 : end + 1 + k].tolist()
