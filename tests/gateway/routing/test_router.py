from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from llmserve.gateway.config import load_config
from llmserve.gateway.routing.router import ModelRouter, RandomScorer, RouterConfig, request_text, threshold_for_share


def test_a_threshold_calibrated_to_a_share_hits_it_on_held_out_scores():
    rng = np.random.default_rng(7)
    calibration, held_out = rng.beta(2, 5, 400).tolist(), rng.beta(2, 5, 4000)
    for share in (0.1, 0.3, 0.5, 0.8):
        routed = float((held_out > threshold_for_share(calibration, share)).mean())
        # the calibration quantile's own sampling error (n=400) dominates: 3 sigma of a binomial share
        assert abs(routed - share) < 3 * math.sqrt(share * (1 - share) / 400)
    assert threshold_for_share(calibration, 0.0) == math.inf
    assert threshold_for_share(calibration, 1.0) == -math.inf


def test_on_the_calibration_scores_themselves_the_share_is_exact():
    scores = [0.9, 0.1, 0.5, 0.7, 0.3, 0.2, 0.8, 0.4, 0.6, 0.0]
    for strong in range(11):
        threshold = threshold_for_share(scores, strong / 10)
        assert sum(s > threshold for s in scores) == strong


def test_the_random_router_sends_its_share_to_the_strong_model():
    router = ModelRouter(RouterConfig("r", "weak", "strong", router="random", strong_share=0.25), RandomScorer(3),
                         None)
    decisions = [asyncio.run(router.decide("chat", {"messages": [{"role": "user", "content": "x"}]}))
                 for _ in range(2000)]
    share = sum(d.chose_strong for d in decisions) / len(decisions)
    assert abs(share - 0.25) < 3 * math.sqrt(0.25 * 0.75 / 2000)
    assert {d.model for d in decisions} == {"weak", "strong"}


def test_a_router_reads_the_last_user_message_or_the_prompt():
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "second"}]}]}
    assert request_text("chat", body) == "second"
    assert request_text("completions", {"prompt": "def f():"}) == "def f():"
    assert request_text("completions", {"prompt": [1, 2, 3]}) == ""


@pytest.mark.parametrize("routers, message", [
    ("{r: {weak: small, strong: nope, router: random}}", "routers.r.strong: 'nope' is not one of the models"),
    ("{small: {weak: small, strong: big, router: random}}", "a model has that name already"),
    ("{r: {weak: small, strong: small, router: random}}", "the same model"),
    ("{r: {weak: small, strong: big, router: oracle}}", "router must be one of"),
    ("{r: {weak: small, strong: big, router: learned}}", "needs its file"),
    ("{r: {weak: small, strong: big, router: judge}}", "needs a threshold or a file"),
    ("{r: {weak: small, strong: big, router: random, strong_share: 1.5}}", "strong_share must be in"),
    ("{r: {weak: small, strong: big, router: random, votes: 3}}", "unknown setting"),
])
def test_a_bad_router_is_refused_with_a_clear_message(tmp_path, routers, message):
    path = tmp_path / "gw.yaml"
    path.write_text(f"models: {{small: {{upstreams: [http://a]}}, big: {{upstreams: [http://b]}}}}\n"
                    f"routers: {routers}")
    with pytest.raises(ValueError, match=message):
        load_config(path)
