"""Routed names through a real gateway in front of real replicas, asked with the official `openai` client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from llmserve.embeddings import Embedder
from llmserve.gateway.routing.judge import judge_request, rating
from llmserve.gateway.routing.learned import LearnedScorer, train
from llmserve.gateway.routing.router import threshold_for_share
from tests.gateway.conftest import MODEL, GatewayProcess

EASY = ["Hello!", "Hi there, how are you?", "Good morning.", "Thanks a lot!", "Say hi to my friend.", "Hey.",
        "What's up?", "Nice to meet you."]
HARD = ["Write a Python function that merges two sorted linked lists in place.",
        "Implement Dijkstra's shortest path algorithm with a binary heap in Python.",
        "Write a thread-safe LRU cache class in Python with O(1) operations.",
        "Implement a parser for arithmetic expressions with operator precedence.",
        "Write a function that returns all permutations of a list without itertools.",
        "Implement quicksort in Python, iteratively, with a median-of-three pivot.",
        "Write a Python decorator that retries a function with exponential backoff.",
        "Implement a trie with insert, search and prefix counting."]
PRICES = {"small": {"input_per_million": 1.0, "output_per_million": 2.0},
          "big": {"input_per_million": 10.0, "output_per_million": 20.0}}


@pytest.fixture(scope="module")
def router_file(tmp_path_factory) -> tuple[str, dict]:
    embedder = Embedder()
    try:
        data = train(embedder, EASY + HARD, [False] * len(EASY) + [True] * len(HARD))
    finally:
        embedder.close()
    path = tmp_path_factory.mktemp("router") / "learned.json"
    path.write_text(json.dumps(data))
    return str(path), data


@pytest.fixture
def gateway(tmp_path, replicas, router_file):
    small, big = replicas[0].base, replicas[1].base
    config = {"models": {name: {"upstreams": [url], "upstream_model": MODEL, "price": PRICES[name]}
                         for name, url in (("small", small), ("big", big))},
              "routers": {"auto": {"weak": "small", "strong": "big", "router": "learned", "file": router_file[0],
                                   "strong_share": 0.5},
                          "judged": {"weak": "small", "strong": "big", "router": "judge", "threshold": 3.0}},
              "health": {"interval": 0.5}}
    proc = GatewayProcess(tmp_path, config)
    yield proc
    proc.stop()


def test_a_learned_router_sends_each_request_where_its_score_says(gateway, router_file):
    _, data = router_file
    embedder = Embedder()
    scorer = LearnedScorer(data, embedder)
    threshold = threshold_for_share(data["calibration_scores"], 0.5)
    c = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="none", max_retries=0, timeout=120)
    assert {"auto", "judged", "small", "big"} <= {m.id for m in c.models.list()}
    chosen = []
    for text in ("Good evening!", "Implement a red-black tree in Python with insertion and deletion."):
        expected_score = asyncio.run(scorer.score(text))
        raw = c.chat.completions.with_raw_response.create(model="auto", messages=[{"role": "user", "content": text}],
                                                          max_tokens=6, temperature=0)
        model = raw.headers["x-llmserve-route"]
        assert model == ("big" if expected_score > threshold else "small")
        assert f"score={expected_score:.4g}" in raw.headers["x-llmserve-route-reason"]
        usage = raw.parse().usage
        price = PRICES[model]
        assert usage.model_extra["cost"] == pytest.approx(
            (usage.prompt_tokens * price["input_per_million"] + usage.completion_tokens * price["output_per_million"])
            / 1e6)
        chosen.append((model, usage))
    embedder.close()
    assert [m for m, _ in chosen] == ["small", "big"]  # the router learned the difference
    m = gateway.metrics()
    assert m["llmserve:gateway_routed_requests_total{model=small,router=auto}"] == 1
    assert m["llmserve:gateway_routed_requests_total{model=big,router=auto}"] == 1
    # the request the weak model took saved the difference between the two prices for its tokens
    usage = chosen[0][1]
    saved = (usage.prompt_tokens * 9.0 + usage.completion_tokens * 18.0) / 1e6
    assert m["llmserve:gateway_saved_dollars_total{lever=routing,model=small,namespace=default}"] == \
        pytest.approx(saved)


def test_a_judge_router_rates_the_request_with_its_model(gateway, replicas):
    text = "Write a haiku about the sea."
    direct = httpx.post(f"{replicas[0].base}/v1/chat/completions", timeout=60,
                        json={**judge_request(text), "model": MODEL}).json()
    expected = rating(direct)
    with httpx.stream("POST", f"{gateway.base}/v1/chat/completions", timeout=60, json={
            "model": "judged", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": True,
            "temperature": 0}) as r:
        assert r.status_code == 200
        assert r.headers["x-llmserve-route"] == ("big" if expected > 3.0 else "small")
        reason = r.headers["x-llmserve-route-reason"]
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert reason.startswith("router=judge;") and float(reason.split("score=")[1].split()[0]) == \
        pytest.approx(expected, rel=1e-3)
    assert events[-1] == "data: [DONE]"
    assert gateway.total("llmserve:gateway_cost_dollars_total") > 0  # the judge's call is paid for too
    m = gateway.metrics()
    assert m["llmserve:gateway_cost_dollars_total{model=small,namespace=router}"] > 0
