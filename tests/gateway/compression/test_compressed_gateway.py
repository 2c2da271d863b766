"""Compression through a real gateway in front of real replicas, asked with the official `openai` client: the
header says what was done, the upstream is sent fewer tokens, and /metrics prices what was kept from it."""

import httpx
import openai
import pytest

from tests.gateway.compression.texts import PASSAGE, QUESTION
from tests.gateway.conftest import MODEL, GatewayProcess

PRICE = {"input_per_million": 3.0, "output_per_million": 6.0}
MESSAGES = [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": PASSAGE + "\n\n" + QUESTION}]


@pytest.fixture
def gateway(tmp_path, replicas):
    config = {"models": {MODEL: {"upstreams": [r.base for r in replicas], "price": PRICE,
                                 "compress": {"scorer": MODEL, "rate": 0.5, "min_tokens": 200}},
                         "dead": {"upstreams": ["http://127.0.0.1:9"]}},  # nothing listens there
              "health": {"interval": 0.5}}
    proc = GatewayProcess(tmp_path, config)
    yield proc
    proc.stop()


def tokens(header: str) -> tuple[int, int]:
    before, after = header.split("tokens=")[1].split("->")
    return int(before), int(after)


def test_the_policy_compresses_the_context_and_prices_what_it_removed(gateway):
    c = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="none", max_retries=0, timeout=120)
    ask = dict(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    raw = c.chat.completions.with_raw_response.create(**ask, extra_body={"compress": False})
    assert raw.headers["x-llmserve-compression"] == "skipped: disabled (compress: false)"
    full = raw.parse().usage

    raw = c.chat.completions.with_raw_response.create(**ask)  # the model's policy: rate 0.5
    header = raw.headers["x-llmserve-compression"]
    before, after = tokens(header)
    assert header.startswith(f"rate={after / before:.2f} ") and after <= 0.5 * before
    usage = raw.parse().usage
    assert usage.prompt_tokens < full.prompt_tokens
    # the scorer is the model itself: its count of the removed tokens is what the upstream was spared
    assert abs((full.prompt_tokens - usage.prompt_tokens) - (before - after)) <= 3
    assert usage.model_extra["cost"] == pytest.approx((usage.prompt_tokens * 3.0 + usage.completion_tokens * 6.0) / 1e6)

    m = gateway.metrics()
    assert m[f"llmserve:gateway_saved_dollars_total{{lever=compression,model={MODEL},namespace=default}}"] == \
        pytest.approx((before - after) * 3.0 / 1e6)
    assert m[f"llmserve:gateway_compression_removed_tokens_total{{model={MODEL}}}"] == before - after
    assert m[f"llmserve:gateway_compressions_total{{model={MODEL},outcome=compressed}}"] == 1
    assert m[f"llmserve:gateway_compressions_total{{model={MODEL},outcome=disabled}}"] == 1
    scoring = m[f"llmserve:gateway_cost_dollars_total{{model={MODEL},namespace=compressor}}"]
    assert scoring == pytest.approx(before * 3.0 / 1e6, rel=0.05)  # the scorer's own call is paid for too

    # the same request again: a cache hit, served without asking the scorer
    raw = c.chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-llmserve-cache"] == "hit" and "x-llmserve-compression" not in raw.headers
    assert gateway.metrics()[f"llmserve:gateway_compressions_total{{model={MODEL},outcome=compressed}}"] == 1


def test_a_request_sets_its_own_rate_and_a_failing_scorer_costs_only_the_compression(gateway):
    c = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="none", max_retries=0, timeout=120)
    ask = dict(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    raw = c.chat.completions.with_raw_response.create(**ask, extra_body={"compress": {"rate": 0.7}})
    before, after = tokens(raw.headers["x-llmserve-compression"])
    assert 0.5 * before < after <= 0.7 * before

    raw = c.chat.completions.with_raw_response.create(**ask, extra_body={"compress": {"scorer": "dead"}})
    assert raw.headers["x-llmserve-compression"].startswith("skipped: scorer_error")
    plain = c.chat.completions.create(**ask, extra_body={"compress": False})
    assert raw.parse().usage.prompt_tokens == plain.usage.prompt_tokens  # sent as it came
    assert "scorer" in gateway.log() and "uncompressed" in gateway.log()

    with pytest.raises(openai.BadRequestError, match="compress"):
        c.chat.completions.create(**ask, extra_body={"compress": {"rate": 2}})

    # a stream gets the header with its first bytes, and its usage shows the shorter prompt
    with httpx.stream("POST", f"{gateway.base}/v1/chat/completions", timeout=120, json={
            **ask, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["x-llmserve-compression"].startswith("rate=")
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"prompt_tokens"' in events[-1] and plain.usage.prompt_tokens > \
        int(events[-1].split('"prompt_tokens":')[1].split(",")[0])
