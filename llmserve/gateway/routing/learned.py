"""The learned router: MiniLM sentence embeddings and a logistic regression that predicts whether the weak
model fails a request, trained on outcomes `llmserve eval` measured (e.g. which HumanEval problems the weak
model solves). RouteLLM's classifier routers, at the size our data allows: 384 weights and a bias, which
a few hundred labelled prompts can fit without memorising them (L2-regularised), kept as JSON (no pickle).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmserve.embeddings import Embedder


def fit_logistic(features: np.ndarray, labels: np.ndarray, l2: float = 1.0,
                 steps: int = 50) -> tuple[np.ndarray, float]:
    """Weights and bias minimising the mean log loss + l2/2n |w|^2 (Newton's method: the problem is small and
    convex, so it converges in a handful of steps without a learning rate to tune). The bias is not penalised."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    n, d = x.shape
    if n == 0 or not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("need labelled examples with labels 0 or 1")
    design = np.hstack([x, np.ones((n, 1))])
    theta = np.zeros(d + 1)
    penalty = np.full(d + 1, l2 / n)
    penalty[-1] = 0.0
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-design @ theta))
        gradient = design.T @ (p - y) / n + penalty * theta
        hessian = (design.T * (p * (1.0 - p))) @ design / n + np.diag(penalty) + 1e-9 * np.eye(d + 1)
        step = np.linalg.solve(hessian, gradient)
        theta -= step
        if np.abs(step).max() < 1e-10:
            break
    return theta[:-1], float(theta[-1])


def predict(weights: np.ndarray, bias: float, features: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(np.asarray(features, dtype=np.float64) @ weights + bias)))


def out_of_fold_scores(features: np.ndarray, labels: np.ndarray, l2: float, folds: int = 5,
                       seed: int = 0) -> np.ndarray:
    """Each example's score from a classifier not trained on it: what new requests' scores look like. Scores of
    the training examples themselves are more extreme than new ones would be, and calibrating on them would
    miss the requested share."""
    order = np.random.default_rng(seed).permutation(len(labels))
    scores = np.empty(len(labels))
    for part in np.array_split(order, folds):
        rest = np.setdiff1d(order, part)
        weights, bias = fit_logistic(features[rest], labels[rest], l2)
        scores[part] = predict(weights, bias, features[part])
    return scores


def train(embedder: Embedder, texts: list[str], weak_failed: list[bool], l2: float = 1.0,
          source: str = "") -> dict[str, Any]:
    """A router file: the classifier fitted on every example, and out-of-fold scores as its calibration set."""
    features = embedder.embed(texts)
    labels = np.asarray(weak_failed, dtype=np.float64)
    weights, bias = fit_logistic(features, labels, l2)
    return {"router": "learned", "embedding": "all-MiniLM-L6-v2", "label": "the weak model fails", "l2": l2,
            "trained_on": source, "examples": len(texts), "weights": weights.tolist(), "bias": bias,
            "calibration_scores": out_of_fold_scores(features, labels, l2).tolist()}


class LearnedScorer:
    """P(the weak model fails this text), from the router file's classifier."""

    def __init__(self, data: dict[str, Any], embedder: Embedder) -> None:
        self.weights = np.asarray(data["weights"], dtype=np.float64)
        self.bias = float(data["bias"])
        if self.weights.shape != (embedder.dim,):
            raise ValueError(f"the router's weights have shape {self.weights.shape}, not ({embedder.dim},)")
        self.embedder = embedder

    async def score(self, text: str) -> float:
        return float(predict(self.weights, self.bias, await self.embedder.aembed([text]))[0])
