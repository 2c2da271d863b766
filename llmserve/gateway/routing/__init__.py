"""Model routing (the gateway's `routers:`): send each request to the cheapest model expected to answer it well."""

from __future__ import annotations

from llmserve.embeddings import Embedder
from llmserve.gateway.routing.judge import Ask, JudgeScorer
from llmserve.gateway.routing.router import ModelRouter, RandomScorer, RouterConfig, load_router_file


def build_router(config: RouterConfig, ask_judge: Ask, embedder: Embedder | None) -> ModelRouter:
    """The one place a router kind becomes a scorer. `ask_judge` sends a chat request to the judge model;
    `embedder` is needed by the learned router only."""
    data = load_router_file(config.file) if config.file else {}
    if data and data["router"] != config.router:
        raise ValueError(f"routers.{config.name}: {config.file} holds a {data['router']} router, "
                         f"not {config.router}")
    if config.router == "learned":
        from llmserve.gateway.routing.learned import LearnedScorer

        scorer = LearnedScorer(data, embedder or Embedder())
    elif config.router == "judge":
        scorer = JudgeScorer(ask_judge)
    else:
        scorer = RandomScorer(config.seed)
    return ModelRouter(config, scorer, data.get("calibration_scores"))
