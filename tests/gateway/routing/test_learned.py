from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from llmserve.embeddings import Embedder
from llmserve.gateway.routing.learned import LearnedScorer, fit_logistic, predict, train
from llmserve.gateway.routing.router import ModelRouter, RouterConfig
from llmserve.gateway.routing.train import humaneval_outcomes

# which HumanEval problems qwen2.5-coder-0.5b solves, measured by `llmserve eval` (docs/performance.md, "The gateway")
WEAK_RESULTS = Path(__file__).parents[3] / "benchmarks" / "results" / "gateway" / "humaneval_qwen0.5b.json"


def test_the_fitted_classifier_is_the_regularised_optimum():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5))
    y = (x @ np.array([2.0, -1.0, 0.0, 0.5, 0.0]) + 0.3 + rng.normal(size=200) > 0).astype(float)
    weights, bias = fit_logistic(x, y, l2=1.0)
    p = predict(weights, bias, x)
    gradient_w = x.T @ (p - y) / len(y) + weights / len(y)
    assert np.abs(gradient_w).max() < 1e-8 and abs((p - y).mean()) < 1e-8  # zero gradient: the optimum
    assert weights[0] > 1.0 and weights[1] < -0.5  # and it found the signal's direction
    with pytest.raises(ValueError, match="labels 0 or 1"):
        fit_logistic(x, y * 2, l2=1.0)


@pytest.fixture(scope="module")
def embedder():
    e = Embedder()
    yield e
    e.close()


def test_a_router_trained_on_measured_outcomes_hits_its_share_on_held_out_problems(embedder):
    outcomes = humaneval_outcomes(WEAK_RESULTS)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(outcomes))
    train_set, held_out = [outcomes[i] for i in order[:82]], [outcomes[i] for i in order[82:]]
    data = train(embedder, [o.text for o in train_set], [not o.passed for o in train_set])
    assert len(data["calibration_scores"]) == 82 and len(data["weights"]) == embedder.dim
    scorer = LearnedScorer(data, embedder)
    scores = [asyncio.run(scorer.score(o.text)) for o in held_out]
    for share in (0.3, 0.5):
        router = ModelRouter(RouterConfig("coder", "weak", "strong", file="-", strong_share=share), scorer,
                             data["calibration_scores"])
        routed = sum(s > router.threshold for s in scores) / len(scores)
        # two samples of 82: the calibration quantile's error and the held-out share's, 3 sigma
        assert abs(routed - share) < 3 * math.sqrt(share * (1 - share) * (1 / 82 + 1 / 82))
    # what the gateway will do with it: the same score for the same text, through the router's decision
    decision = asyncio.run(router.decide("chat", {"messages": [{"role": "user", "content": held_out[0].text}]}))
    assert decision.score == pytest.approx(scores[0]) and decision.model == ("strong" if scores[0] > router.threshold
                                                                             else "weak")
