"""Prompt-lookup proposals: the tokens that followed the last time the sequence's current ending appeared.

Output that repeats its input (an edited file, a quoted document, a refactored function) is full of
n-grams seen before; after the longest recent match of the sequence's last `max_n` (down to `min_n`)
tokens, the tokens that came next are a free guess at what comes now. No model runs: a proposal costs a
scan of the request's own tokens, and a sequence without such a match proposes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmserve.engine.request import Request


class NgramProposer:
    catch_up_seconds = 0.0  # a lookup keeps no state to bring up to date
    catches_up = False

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[Request], num_tokens: dict[str, int]) -> dict[str, list[int]]:
        """The speculator's call: up to num_tokens[id] tokens for each request that has a match."""
        drafts = {r.request_id: self.lookup(r.all_token_ids, num_tokens[r.request_id]) for r in requests}
        return {rid: draft for rid, draft in drafts.items() if draft}

    def lookup(self, token_ids: list[int], num_tokens: int | None = None) -> list[int]:
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
