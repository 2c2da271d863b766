"""Dollars: a self-hosted fleet by the hour against an API by the token, and where they cross.

Why a step function: replicas come whole, so self-hosting costs ceil(traffic / capacity) x $/hour while
an API costs traffic x $/token. The break-even traffic is where the API's line first reaches the
fleet's cost; with a cache in front of either, both pay for cache misses only, so the hit share scales
both sides alike and cancels out of the comparison.

API prices (USD per 1M tokens, input / output) are list prices published in 2025, rounded: edit the table
or add your own with --api NAME=IN,OUT; they change often.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HOURS_PER_MONTH = 730.0  # 365 x 24 / 12
SECONDS_PER_MONTH = HOURS_PER_MONTH * 3600.0


@dataclass(frozen=True)
class ApiPrice:
    name: str
    input_per_m: float  # $ per 1M input tokens
    output_per_m: float

    def __post_init__(self) -> None:
        if self.input_per_m < 0 or self.output_per_m < 0:
            raise ValueError(f"API {self.name!r}: prices must be >= 0")

    def dollars_per_request(self, prompt_tokens: float, output_tokens: float) -> float:
        return (prompt_tokens * self.input_per_m + output_tokens * self.output_per_m) / 1e6


API_PRICES: dict[str, ApiPrice] = {p.name: p for p in (
    ApiPrice("gpt-4o-mini", 0.15, 0.60),
    ApiPrice("gpt-4o", 2.50, 10.00),
    ApiPrice("claude-3.5-haiku", 0.80, 4.00),
    ApiPrice("claude-sonnet-4", 3.00, 15.00),
    ApiPrice("gemini-2.0-flash", 0.10, 0.40),
    ApiPrice("deepseek-v3", 0.27, 1.10),
)}


def parse_api_price(text: str) -> ApiPrice:
    """'name=0.15,0.60' -> ApiPrice (input, output $ per 1M tokens)."""
    name, sep, prices = text.partition("=")
    parts = prices.split(",")
    if not sep or not name.strip() or len(parts) != 2:
        raise ValueError(f"bad API price {text!r}: use NAME=INPUT,OUTPUT ($ per 1M tokens)")
    try:
        return ApiPrice(name.strip(), float(parts[0]), float(parts[1]))
    except ValueError as exc:
        raise ValueError(f"bad API price {text!r}: {exc}") from None


def replicas_needed(miss_rate: float, capacity: float) -> int:
    """Whole replicas for `miss_rate` requests/s when one sustains `capacity` within the SLO; at least one
    (a service that is up costs its machine even when idle)."""
    if capacity <= 0:
        raise ValueError("a replica with no capacity cannot serve any traffic")
    return max(1, math.ceil(miss_rate / capacity - 1e-9))


def self_hosted_per_month(miss_rate: float, capacity: float, dollars_per_hour: float) -> float:
    return replicas_needed(miss_rate, capacity) * dollars_per_hour * HOURS_PER_MONTH


def api_per_month(miss_rate: float, api: ApiPrice, prompt_tokens: float, output_tokens: float) -> float:
    return miss_rate * SECONDS_PER_MONTH * api.dollars_per_request(prompt_tokens, output_tokens)


def dollars_per_million_tokens(monthly: float, miss_rate: float, tokens_per_request: float) -> float | None:
    """Self-hosted $ per 1M tokens (prompt + output) actually processed."""
    tokens = miss_rate * SECONDS_PER_MONTH * tokens_per_request
    return monthly / tokens * 1e6 if tokens > 0 else None


@dataclass(frozen=True)
class BreakEven:
    """Miss rates (requests/s) where self-hosting starts to pay against one API."""

    api: str
    first: float | None  # the lowest rate from which one replica costs less than the API; None: never
    always_above: float | None  # from here on self-hosting is cheaper at every rate; None: never


def break_even(api: ApiPrice, capacity: float, dollars_per_hour: float, prompt_tokens: float,
               output_tokens: float) -> BreakEven:
    """The API costs k x rate per month, n replicas cost n x H while rate <= n x capacity. Self-hosting
    is cheaper on step n for rate in (n H / k, n capacity]. So it ever pays only if capacity x k > H, first
    at H / k; past each step's edge the API can win again (just above n x capacity it costs n x capacity
    x k, the fleet (n+1) H), until n x capacity x k >= (n+1) H."""
    k = SECONDS_PER_MONTH * api.dollars_per_request(prompt_tokens, output_tokens)
    h = dollars_per_hour * HOURS_PER_MONTH
    if k <= 0:
        return BreakEven(api.name, None, None)
    if h <= 0:
        return BreakEven(api.name, 0.0, 0.0)
    if capacity * k <= h:
        return BreakEven(api.name, None, None)
    first = h / k
    # the last step n whose edge the API still undercuts: n capacity k < (n+1) h  <=>  n < h / (capacity k - h)
    n_last = math.ceil(h / (capacity * k - h)) - 1
    always = first if n_last < 1 else (n_last + 1) * h / k
    return BreakEven(api.name, first, always)
