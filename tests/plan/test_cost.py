"""Dollars against hand computation: monthly cost, cost per 1M tokens, replicas, break-even traffic."""

from __future__ import annotations

import pytest

from llmserve.plan.cost import (
    ApiPrice,
    api_per_month,
    break_even,
    dollars_per_million_tokens,
    parse_api_price,
    replicas_needed,
    self_hosted_per_month,
)

SECONDS_PER_MONTH = 730 * 3600  # 2,628,000


def test_self_hosted_cost_and_cost_per_million_tokens() -> None:
    # 2.5 req/s on replicas of 1 req/s: 3 machines at $2/hour for 730 hours = $4,380 a month
    assert replicas_needed(2.5, 1.0) == 3 and replicas_needed(3.0, 1.0) == 3 and replicas_needed(0.0, 1.0) == 1
    monthly = self_hosted_per_month(2.5, 1.0, 2.0)
    assert monthly == pytest.approx(4380.0)
    # tokens a month: 2.5 req/s x 2,628,000 s x (500 + 100) tokens = 3.942e9 -> $1.111 per 1M
    assert dollars_per_million_tokens(monthly, 2.5, 600) == pytest.approx(4380 / 3942.0)


def test_api_cost() -> None:
    api = ApiPrice("x", input_per_m=0.5, output_per_m=1.5)
    # per request: 500 x 0.5e-6 + 100 x 1.5e-6 = $0.0004; 2 req/s for a month: $2,102.40
    assert api.dollars_per_request(500, 100) == pytest.approx(0.0004)
    assert api_per_month(2.0, api, 500, 100) == pytest.approx(0.0004 * 2 * SECONDS_PER_MONTH)


def test_break_even_hand_computed() -> None:
    # A replica: 10 req/s at $1000/730 an hour (= $1000 a month). The API: $150 a month per req/s
    # (k = 2,628,000 s x p per request => p = 150 / 2,628,000).
    p = 150 / SECONDS_PER_MONTH
    api = ApiPrice("x", input_per_m=p * 1e6, output_per_m=0.0)  # one input token per request
    be = break_even(api, capacity=10.0, dollars_per_hour=1000 / 730, prompt_tokens=1, output_tokens=0)
    assert be.first == pytest.approx(1000 / 150)  # 6.67 req/s: one replica costs what the API does
    # step 2 (10-20 req/s, $2000): the API is cheaper below 13.33 req/s; step 3 ($3000) from 20 req/s on
    # costs less than the API's $3000 there, and so on: always cheaper above 13.33
    assert be.always_above == pytest.approx(2000 / 150)
    # a replica whose full capacity is worth less than it costs at the API's price never breaks even
    never = break_even(api, capacity=6.0, dollars_per_hour=1000 / 730, prompt_tokens=1, output_tokens=0)
    assert never.first is None and never.always_above is None
    # far cheaper machines: cheaper from H/k on and never again beaten past a step edge
    cheap = break_even(api, capacity=10.0, dollars_per_hour=100 / 730, prompt_tokens=1, output_tokens=0)
    assert cheap.first == pytest.approx(100 / 150) and cheap.always_above == pytest.approx(100 / 150)


def test_parse_api_price() -> None:
    assert parse_api_price("mine=0.2,0.8") == ApiPrice("mine", 0.2, 0.8)
    for bad in ("mine", "mine=0.2", "=1,2", "mine=a,b", "mine=-1,2"):
        with pytest.raises(ValueError):
            parse_api_price(bad)
