"""Per-key rate limits over a sliding minute: requests per minute (counted on arrival) and tokens per
minute (counted from each answer's usage, so a key past its budget is refused until the window frees it).

Kept per gateway process: with N gateways a key can reach N times its limits (LiteLLM's proxy has the
same property without its enterprise Redis limiter); the limits protect the replicas from one noisy key.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.gateway.config import APIKey

WINDOW_S = 60.0


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0

    def trim(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


@dataclass(frozen=True)
class Refusal:
    limit: str  # "requests" or "tokens"
    retry_after: int  # seconds
    message: str


class RateLimiter:
    def __init__(self) -> None:
        self._windows: dict[str, _Window] = {}

    def admit(self, key: APIKey, now: float | None = None) -> Refusal | None:
        """Count a request against `key`, or say why it must wait (nothing is counted then)."""
        if key.requests_per_minute is None and key.tokens_per_minute is None:
            return None
        now = time.monotonic() if now is None else now
        window = self._windows.setdefault(key.key, _Window())
        window.trim(now)
        if key.requests_per_minute is not None and len(window.requests) >= key.requests_per_minute:
            wait = window.requests[0] + WINDOW_S - now
            return Refusal("requests", max(1, math.ceil(wait)),
                           f"rate limit reached for namespace {key.namespace!r}: "
                           f"{key.requests_per_minute} requests per minute")
        if key.tokens_per_minute is not None and window.token_sum >= key.tokens_per_minute:
            # wait until enough old usage leaves the window to get under the budget
            excess, wait = window.token_sum - key.tokens_per_minute, WINDOW_S
            for at, n in window.tokens:
                excess -= n
                if excess < 0:
                    wait = at + WINDOW_S - now
                    break
            return Refusal("tokens", max(1, math.ceil(wait)),
                           f"rate limit reached for namespace {key.namespace!r}: "
                           f"{key.tokens_per_minute} tokens per minute")
        window.requests.append(now)
        return None

    def spend(self, key: APIKey, tokens: int, now: float | None = None) -> None:
        """Record the tokens (prompt + completion) an answer cost."""
        if key.tokens_per_minute is None or tokens <= 0:
            return
        window = self._windows.setdefault(key.key, _Window())
        window.tokens.append((time.monotonic() if now is None else now, tokens))
        window.token_sum += tokens
