from __future__ import annotations

from llmserve.gateway.config import APIKey
from llmserve.gateway.ratelimit import RateLimiter


def test_requests_per_minute_slide():
    key, limiter = APIKey("k", requests_per_minute=2), RateLimiter()
    assert limiter.admit(key, now=0.0) is None and limiter.admit(key, now=10.0) is None
    refusal = limiter.admit(key, now=20.0)
    assert refusal is not None and refusal.limit == "requests" and refusal.retry_after == 40
    assert limiter.admit(key, now=60.5) is None  # the first request left the window


def test_tokens_per_minute_count_what_answers_cost():
    key, limiter = APIKey("k", tokens_per_minute=100), RateLimiter()
    assert limiter.admit(key, now=0.0) is None
    limiter.spend(key, 70, now=1.0)
    assert limiter.admit(key, now=2.0) is None
    limiter.spend(key, 50, now=3.0)
    refusal = limiter.admit(key, now=4.0)
    assert refusal is not None and refusal.limit == "tokens"
    assert refusal.retry_after == 57  # when the 70 leave, 50 < 100 remain
    assert limiter.admit(key, now=61.5) is None


def test_unlimited_keys_and_keys_apart():
    limiter = RateLimiter()
    free, tight = APIKey("a"), APIKey("b", requests_per_minute=1)
    assert all(limiter.admit(free, now=0.0) is None for _ in range(100))
    assert limiter.admit(tight, now=0.0) is None and limiter.admit(tight, now=0.0) is not None
