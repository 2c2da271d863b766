"""Model routing: a name clients send that the gateway resolves, per request, to a weak (cheap) or a strong model.

A router scores how much a request needs the strong model; a threshold turns the score into a choice. The
threshold is calibrated as RouteLLM calibrates it: to a target share of strong-model calls on a calibration
set of scores (kept in the router's file), so an operator says "send 30 % to the strong model", not a raw
number whose meaning changes with every router. The scorers (learned, judge, random) plug in here and only
here; the gateway sees a `RouteDecision`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ROUTERS = ("learned", "judge", "random")


@dataclass(frozen=True)
class RouterConfig:
    """One routed name (YAML `routers: {NAME: {...}}`)."""

    name: str
    weak: str  # a model of `models:`, the cheap one
    strong: str  # a model of `models:`, the one the hard requests need
    router: str = "learned"  # learned | judge | random
    file: str | None = None  # learned: its weights; learned and judge: calibration scores
    strong_share: float | None = 0.5  # calibrate the threshold to send this share to `strong`
    threshold: float | None = None  # or give the threshold itself (judge: an expected 1-5 rating)
    judge_model: str | None = None  # judge: the model that rates complexity (default: `weak`)
    seed: int = 0  # random: its generator's seed

    def __post_init__(self) -> None:
        where = f"routers.{self.name}"
        if self.router not in ROUTERS:
            raise ValueError(f"{where}: router must be one of {', '.join(ROUTERS)}, not {self.router!r}")
        if self.weak == self.strong:
            raise ValueError(f"{where}: weak and strong are the same model")
        if self.strong_share is not None and not 0.0 <= self.strong_share <= 1.0:
            raise ValueError(f"{where}: strong_share must be in [0, 1]")
        if self.router == "learned" and not self.file:
            raise ValueError(f"{where}: a learned router needs its file (llmserve.gateway.routing.train writes it)")
        if self.router == "judge" and self.threshold is None and not self.file:
            raise ValueError(f"{where}: a judge router needs a threshold or a file of calibration scores")


@dataclass(frozen=True)
class RouteDecision:
    name: str  # the routed name the client sent
    model: str  # the model chosen
    strong_model: str
    score: float
    threshold: float
    router: str  # the scorer's kind, or "fallback" when it could not score

    @property
    def chose_strong(self) -> bool:
        return self.model == self.strong_model

    def reason(self) -> str:
        side = ">" if self.score > self.threshold else "<="
        return f"router={self.router}; score={self.score:.4g} {side} threshold={self.threshold:.4g}"


class Scorer(Protocol):
    """How much a request's text needs the strong model: higher, more."""

    async def score(self, text: str) -> float: ...


class RandomScorer:
    """The baseline every router must beat: a uniform score, so a share s of requests go to the strong model."""

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    async def score(self, text: str) -> float:
        return self._random.random()


def threshold_for_share(scores: list[float], share: float) -> float:
    """The threshold above which `share` of `scores` lie (a request is strong when its score is above it): half
    way between the two scores that bound that share, so a score equal to one of them is decided the same
    way it was on the calibration set."""
    if not scores:
        raise ValueError("no calibration scores")
    ordered = sorted(scores)
    n = len(ordered)
    strong = round(share * n)
    if strong <= 0:
        return math.inf
    if strong >= n:
        return -math.inf
    return (ordered[n - strong - 1] + ordered[n - strong]) / 2.0


def request_text(route: str, body: dict[str, Any]) -> str:
    """What a router reads: the last user message of a chat (its text parts), or a completion's prompt."""
    if route == "chat":
        for message in reversed(body.get("messages") or []):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):
                    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
                return str(content or "")
        return ""
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def load_router_file(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("router") not in ROUTERS:
        raise ValueError(f"{path}: not a router file (no 'router' of {', '.join(ROUTERS)})")
    return data


class ModelRouter:
    """A routed name: its scorer and the calibrated threshold."""

    def __init__(self, config: RouterConfig, scorer: Scorer, calibration: list[float] | None) -> None:
        self.config = config
        self.scorer = scorer
        if config.threshold is not None:
            self.threshold = float(config.threshold)
        elif calibration:
            self.threshold = threshold_for_share(calibration, config.strong_share or 0.0)
        elif config.router == "random":  # uniform scores: the threshold is the share's complement
            self.threshold = 1.0 - (config.strong_share or 0.0)
        else:
            raise ValueError(f"routers.{config.name}: no threshold and no calibration scores")

    async def decide(self, route: str, body: dict[str, Any]) -> RouteDecision:
        score = await self.scorer.score(request_text(route, body))
        model = self.config.strong if score > self.threshold else self.config.weak
        return RouteDecision(self.config.name, model, self.config.strong, score, self.threshold, self.config.router)

    def fallback(self) -> RouteDecision:
        """When the scorer fails (a judge that does not answer): the strong model, which answers everything well."""
        return RouteDecision(self.config.name, self.config.strong, self.config.strong, math.inf, self.threshold,
                             "fallback")
