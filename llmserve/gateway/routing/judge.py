"""The LLM-judge router: a small model rates a request's complexity from 1 to 5, as the seed's router does.

The rating is read from the first answer token's log-probabilities as an expected value over the digits
1-5, not from the one digit sampled: a continuous score ranks requests that would all get a "3", so a
threshold calibrated to a share of strong calls can hit it. A judge that gives no logprobs (a hosted API
that does not) still works: the digit it wrote is the score.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

PROMPT = ("Rate how hard the following request is for a small AI assistant to answer correctly, from 1 (trivial) "
          "to 5 (very hard). Reply with one digit only.\n\nRequest:\n{text}")
DIGITS = ("1", "2", "3", "4", "5")
MAX_CHARS = 6000  # the request as the judge sees it: enough to judge, bounded in cost

Ask = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]  # a chat completion request -> its answer


def judge_request(text: str) -> dict[str, Any]:
    """The judge's chat completion request (without "model": the caller sends it to the judge)."""
    return {"messages": [{"role": "user", "content": PROMPT.format(text=text[:MAX_CHARS])}], "max_tokens": 1,
            "temperature": 0, "logprobs": True, "top_logprobs": 10}


def rating(answer: dict[str, Any]) -> float:
    """The expected 1-5 rating from the first token's top logprobs, else the digit in the text, else 3."""
    choice = (answer.get("choices") or [{}])[0]
    content = ((choice.get("logprobs") or {}).get("content") or [])
    if content:
        weights = {}
        for entry in content[0].get("top_logprobs") or []:
            token = str(entry.get("token", "")).strip()
            if token in DIGITS and token not in weights:
                weights[token] = math.exp(float(entry["logprob"]))
        total = sum(weights.values())
        if total > 0:
            return sum(int(t) * w for t, w in weights.items()) / total
    found = re.search(r"[1-5]", str((choice.get("message") or {}).get("content") or ""))
    return float(found.group()) if found else 3.0


class JudgeScorer:
    def __init__(self, ask: Ask) -> None:
        self.ask = ask

    async def score(self, text: str) -> float:
        return rating(await self.ask(judge_request(text)))

