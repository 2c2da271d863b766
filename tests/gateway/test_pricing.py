from __future__ import annotations

import pytest

from llmserve.gateway.config import load_config
from llmserve.gateway.pricing import Price


def test_an_api_price_is_its_list_price_per_token():
    price = Price(input_per_million=0.15, output_per_million=0.60)
    # 1200 prompt tokens at $0.15/1M + 300 completion tokens at $0.60/1M
    assert price.cost({"prompt_tokens": 1200, "completion_tokens": 300}) == pytest.approx(0.00018 + 0.00018)
    assert price.cost(None) == 0.0


def test_a_machines_hourly_price_becomes_a_price_per_token_by_its_throughput():
    # $3.60/hour is $0.001/s; 10,000 prompt tokens/s -> $0.1 per 1M; 500 output tokens/s -> $2 per 1M
    price = Price.self_hosted(dollars_per_hour=3.6, input_tokens_per_second=10_000, output_tokens_per_second=500)
    assert price.input_per_million == pytest.approx(0.1)
    assert price.output_per_million == pytest.approx(2.0)
    assert price.cost({"prompt_tokens": 10_000, "completion_tokens": 500}) == pytest.approx(0.002)


def test_prices_come_from_the_config_file(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("""
models:
  hosted: {upstreams: [http://a], price: {input_per_million: 2.5, output_per_million: 10}}
  ours: {upstreams: [http://b], price: {dollars_per_hour: 0.36, input_tokens_per_second: 1000,
                                        output_tokens_per_second: 100}}
  free: {upstreams: [http://c]}
""")
    models = load_config(path).models
    assert models["hosted"].price == Price(2.5, 10.0)
    assert models["ours"].price.output_per_million == pytest.approx(1.0)  # $0.0001/s over 100 tok/s
    assert models["free"].price.cost({"prompt_tokens": 5, "completion_tokens": 5}) == 0.0


@pytest.mark.parametrize("price, message", [
    ("{input_per_million: -1}", "must be >= 0"),
    ("{dollars_per_hour: 1, output_tokens_per_second: 5}", "needs exactly"),
    ("{dollars_per_hour: 1, input_tokens_per_second: 0, output_tokens_per_second: 5}", "> 0"),
    ("{input_per_million: 1, dollars_per_hour: 1}", "needs exactly"),
    ("{per_token: 1}", "unknown setting"),
    ("0.5", "a mapping"),
])
def test_a_bad_price_is_refused_with_a_clear_message(tmp_path, price, message):
    path = tmp_path / "gw.yaml"
    path.write_text(f"models: {{m: {{upstreams: [http://a], price: {price}}}}}")
    with pytest.raises(ValueError, match=message):
        load_config(path)
