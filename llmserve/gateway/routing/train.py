"""Router files from measured outcomes: `python -m llmserve.gateway.routing.train`.

    # which HumanEval problems each model solves, measured by `llmserve eval` (per-problem results kept)
    llmserve eval qwen2.5-coder-0.5b --tasks humaneval --out weak.json
    llmserve eval qwen2.5-coder-1.5b --tasks humaneval --out strong.json
    python -m llmserve.gateway.routing.train learned --weak weak.json --out coder-learned.json
    python -m llmserve.gateway.routing.train judge --weak weak.json --base-url http://127.0.0.1:8000 \\
        --model qwen2.5-coder-0.5b --out coder-judge.json

The learned router learns "the weak model fails this request" from the weak model's results, or, given the
strong model's too (`--strong`), "the weak model fails and the strong one passes" (RouteLLM's "the strong model
wins": a request neither solves then stays with the cheap one). The judge router needs no labels, only its
ratings of the same requests as the calibration set of its threshold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmserve.evaluate.datasets import humaneval_problems
from llmserve.evaluate.humaneval import CHAT_PROMPT


@dataclass(frozen=True)
class Outcome:
    task_id: str
    text: str  # the request as `llmserve eval` sent it (the user message)
    passed: bool


def humaneval_outcomes(eval_file: str | Path) -> list[Outcome]:
    """Per-problem results of an `llmserve eval --tasks humaneval` file, with each problem's chat request."""
    data = json.loads(Path(eval_file).read_text())
    task = data.get("tasks", {}).get("humaneval")
    if not task or not task.get("results"):
        raise ValueError(f"{eval_file}: no per-problem HumanEval results (run llmserve eval --tasks humaneval)")
    if task.get("style", "chat") != "chat":
        raise ValueError(f"{eval_file}: HumanEval was run in {task['style']!r} style; a router reads chat requests")
    prompts = {p["task_id"]: p["prompt"] for p in humaneval_problems()}
    return [Outcome(r["task_id"], CHAT_PROMPT.format(prompt=prompts[r["task_id"]]), bool(r["passed"]))
            for r in task["results"]]


def judge_scores(texts: list[str], base_url: str, model: str, api_key: str | None = None,
                 concurrency: int = 2) -> list[float]:
    """The judge's ratings of `texts`, asked of an OpenAI-compatible server as the gateway would ask it."""
    import httpx
    from tqdm import tqdm

    from llmserve.gateway.routing.judge import JudgeScorer

    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def run() -> list[float]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def ask(request: dict[str, Any]) -> dict[str, Any]:
                response = await client.post(url, json={**request, "model": model}, headers=headers)
                response.raise_for_status()
                return response.json()

            scorer, gate, bar = JudgeScorer(ask), asyncio.Semaphore(concurrency), tqdm(total=len(texts), desc="judge")

            async def one(text: str) -> float:
                async with gate:
                    score = await scorer.score(text)
                bar.update()
                return score

            try:
                return list(await asyncio.gather(*(one(t) for t in texts)))
            finally:
                bar.close()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmserve.gateway.routing.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("router", choices=("learned", "judge"))
    parser.add_argument("--weak", required=True, help="the weak model's `llmserve eval --tasks humaneval` file")
    parser.add_argument("--strong", help="learned: the strong model's results: learn where the strong model wins")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--l2", type=float, default=1.0, help="learned: L2 penalty (default %(default)s)")
    parser.add_argument("--base-url", help="judge: the server of the judge model")
    parser.add_argument("--model", help="judge: the judge model's name on that server")
    parser.add_argument("--api-key")
    args = parser.parse_args(argv)
    try:
        outcomes = humaneval_outcomes(args.weak)
        strong = humaneval_outcomes(args.strong) if args.strong else None
        if strong is not None and [o.task_id for o in strong] != [o.task_id for o in outcomes]:
            raise ValueError(f"{args.weak} and {args.strong} hold different problems")
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    texts = [o.text for o in outcomes]
    if args.router == "learned":
        from llmserve.embeddings import Embedder
        from llmserve.gateway.routing.learned import train

        labels = [not o.passed and (strong is None or s.passed) for o, s in zip(outcomes, strong or outcomes,
                                                                                 strict=True)]
        data = train(Embedder(), texts, labels, args.l2,
                     source=" + ".join(str(p) for p in (args.weak, args.strong) if p))
        data["label"] = "the strong model wins" if strong else "the weak model fails"
    else:
        if not args.base_url or not args.model:
            print("error: a judge router needs --base-url and --model", file=sys.stderr)
            return 2
        data = {"router": "judge", "judge_model": args.model, "calibrated_on": str(args.weak),
                "calibration_scores": judge_scores(texts, args.base_url, args.model, args.api_key)}
    args.out.write_text(json.dumps(data))
    print(f"wrote {args.out}: a {args.router} router, {len(texts)} calibration scores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
