#!/usr/bin/env python3
"""Prompt compression measured: tokens removed and answers kept, on Quoref long passages, against truncation.

    .venv/bin/pip download --no-deps bigbench==1.0.0 -d /tmp/bigbench     # the BIG-bench sdist on PyPI (358 MB)
    .venv/bin/python benchmarks/prompt_compression.py --data /tmp/bigbench/bigbench-1.0.0.tar.gz

The task: BIG-bench's copy of Quoref (natural_instructions/subtask002_quoref_answer_generation), reading
comprehension over Wikipedia passages whose questions need coreference ("the first name of the person who
..."); the answers are spans of the passage. The passages of at least `--min-words` words (about 1-1.6k
tokens with the prompt) and every question on them. Each question is asked through a real `llmserve gateway`
in front of `llmserve serve` replicas (the answering model and the scorer), greedy, in these conditions:

    closed-book     the question alone (what the model knows without the passage: the floor)
    full            the whole passage ("compress": false)
    compress@R      the gateway's compression at rate R (scorer: smollm2-135m)
    head@R, head+tail@R
                    the passage cut to the same number of scorer tokens that compress@R kept: its first ones,
                    or its first and last halves (the middle dropped), the question after it as always

Accuracy: the gold answer, normalised (lower case, no punctuation or articles), is contained in the normalised
answer, which is at most `--max-tokens` tokens. Prompt tokens: the answering model's own count (usage).
Writes benchmarks/results/compression/quoref.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import string
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import machine_facts  # noqa: E402
from gateway import Proc  # noqa: E402

from llmserve.gateway.compression import Compressor  # noqa: E402

TASK = "bigbench-1.0.0/bigbench/benchmark_tasks/natural_instructions/subtask002_quoref_answer_generation/task.json"
SYSTEM = "Answer the question with a short span copied from the passage. Reply with the answer only."
SCORER = "smollm2-135m"


def load_questions(path: Path, min_words: int, limit: int) -> list[dict[str, Any]]:
    """Quoref questions on passages of at least `min_words` words, in the file's order."""
    if path.suffix == ".json":
        task = json.loads(path.read_text())
    else:
        with tarfile.open(path) as tar:
            task = json.load(tar.extractfile(TASK))
    out = []
    for example in task["examples"]:
        passage, _, question = example["input"].rpartition("\nQuestion:")
        passage = passage.removeprefix("Passage:").strip()
        if len(passage.split()) >= min_words:
            out.append({"passage": passage, "question": question.strip(), "answers": example["target"]})
    return out[:limit]


def normalise(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def correct(answer: str, golds: list[str]) -> bool:
    said = normalise(answer)
    return any(normalise(g) and normalise(g) in said for g in golds)


def messages(passage: str | None, question: str) -> list[dict[str, str]]:
    user = f"Question: {question}" if passage is None else f"Passage: {passage}\n\nQuestion: {question}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


async def ask(client: httpx.AsyncClient, url: str, model: str, msgs: list[dict[str, str]], max_tokens: int,
              compress: Any) -> tuple[str, int, str | None]:
    body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "compress": compress}
    r = await client.post(f"{url}/v1/chat/completions", json=body, headers={"cache-control": "no-store"})
    r.raise_for_status()
    answer = r.json()
    return (answer["choices"][0]["message"]["content"] or "", answer["usage"]["prompt_tokens"],
            r.headers.get("x-llmserve-compression"))


def truncated(passage: str, spans: list[tuple[int, int]], keep: int, mode: str) -> str:
    """The passage cut to `keep` of its scorer tokens (`spans`): its first ones, or its first and last halves."""
    if keep >= len(spans):
        return passage
    if mode == "head":
        return passage[:spans[keep - 1][1]]
    head, tail = keep // 2, keep - keep // 2
    return passage[:spans[head - 1][1]] + " ... " + passage[spans[len(spans) - tail][0]:]


async def run(args: argparse.Namespace, gateway_url: str, scorer_url: str) -> list[dict[str, Any]]:
    questions = load_questions(args.data, args.min_words, args.limit)
    print(f"[compression] {len(questions)} questions on {len({q['passage'] for q in questions})} passages",
          flush=True)
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def complete(model: str, request: dict[str, Any]) -> dict[str, Any]:
            r = await client.post(f"{scorer_url}/v1/completions", json={**request, "model": model})
            r.raise_for_status()
            return r.json()

        scorer = Compressor(complete, (SCORER,))
        spans_of: dict[str, list[tuple[int, int]]] = {}
        for n, q in enumerate(questions):
            row: dict[str, Any] = {"question": q["question"], "answers": q["answers"], "results": {}}
            started = time.perf_counter()

            async def condition(name: str, passage: str | None, compress: Any, row=row, q=q) -> str | None:
                answer, prompt_tokens, header = await ask(client, gateway_url, "target", messages(
                    passage, q["question"]), args.max_tokens, compress)
                row["results"][name] = {"answer": answer, "prompt_tokens": prompt_tokens, "header": header,
                                        "correct": correct(answer, q["answers"])}
                return header

            await condition("closed-book", None, False)
            await condition("full", q["passage"], False)
            if q["passage"] not in spans_of:  # the scorer's tokens of the passage, for truncation to its count
                tokens = (await scorer.score(SCORER, [q["passage"]]))[0]
                spans_of[q["passage"]] = [(t.start, t.end) for t in tokens for _ in range(t.count)]
            spans = spans_of[q["passage"]]
            for rate in args.rates:
                header = await condition(f"compress@{rate}", q["passage"], {"rate": rate})
                before, kept = _tokens(header, len(spans))
                kept = max(1, kept - (before - len(spans)))  # the passage's share: the rest (system, cues) is kept
                row["results"][f"compress@{rate}"]["kept_passage_tokens"] = kept
                for mode in args.truncation:
                    await condition(f"{mode}@{rate}", truncated(q["passage"], spans, kept, mode), False)
            rows.append(row)
            marks = " ".join(f"{k}={'Y' if v['correct'] else '.'}" for k, v in row["results"].items())
            print(f"[compression] {n + 1}/{len(questions)} {time.perf_counter() - started:.0f}s {marks}", flush=True)
    return rows


def _tokens(header: str | None, whole: int) -> tuple[int, int]:
    """The context's scorer tokens before and after, from "rate=0.58 tokens=812->471" (skipped: all kept)."""
    if header and "tokens=" in header:
        before, after = header.split("tokens=")[1].split("->")
        return int(before), int(after)
    return whole, whole


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = list(rows[0]["results"])
    full_tokens = [r["results"]["full"]["prompt_tokens"] for r in rows]
    out = []
    for name in names:
        results = [r["results"][name] for r in rows]
        right = sum(x["correct"] for x in results)
        kept = [x["prompt_tokens"] / f for x, f in zip(results, full_tokens, strict=True)]
        out.append({"condition": name, "correct": right, "n": len(rows), "accuracy": right / len(rows),
                    "ci95": _wilson(right, len(rows)),
                    "prompt_tokens_mean": statistics.mean(x["prompt_tokens"] for x in results),
                    "prompt_share_of_full": statistics.mean(kept)})
    return out


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)


def markdown(summary: list[dict[str, Any]], rows: list[dict[str, Any]], facts: dict[str, Any],
             args: argparse.Namespace, seconds: float) -> str:
    lines = [f"# Prompt compression on Quoref long passages ({len(rows)} questions)", "",
             f"Answering model {args.target} (greedy, max_tokens {args.max_tokens}); scorer {SCORER}; "
             f"passages of >= {args.min_words} words; host {facts['cpu']} ({facts['cpus']} CPUs); "
             f"{seconds / 60:.0f} min.", "",
             "| condition | correct | accuracy (95 % CI) | prompt tokens (mean) | share of full prompt |",
             "|---|---|---|---|---|"]
    for s in summary:
        lo, hi = s["ci95"]
        lines.append(f"| {s['condition']} | {s['correct']}/{s['n']} | {s['accuracy']:.2f} ({lo:.2f}-{hi:.2f}) | "
                     f"{s['prompt_tokens_mean']:.0f} | {s['prompt_share_of_full']:.2f} |")
    pairs = []
    for rate in args.rates:
        for mode in args.truncation:
            a, b = f"compress@{rate}", f"{mode}@{rate}"
            wins = sum(r["results"][a]["correct"] and not r["results"][b]["correct"] for r in rows)
            losses = sum(r["results"][b]["correct"] and not r["results"][a]["correct"] for r in rows)
            pairs.append(f"{a} vs {b}: {wins} questions right only compressed, {losses} only truncated")
    return "\n".join([*lines, "", *(f"- {p}" for p in pairs), ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="the bigbench 1.0.0 sdist (.tar.gz) or the task.json")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--rates", type=float, nargs="+", default=[0.6, 0.35])
    p.add_argument("--truncation", nargs="+", default=["head", "head+tail"], choices=["head", "head+tail"])
    p.add_argument("--min-words", type=int, default=650)
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8740, help="the gateway's; the replicas take the next two")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks/results/compression")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    serve = [sys.executable, "-m", "llmserve.cli", "serve", "--no-access-log", "--max-model-len", "4096"]
    procs = []
    try:
        target = Proc("target", [*serve, "--model", args.target, "--port", str(args.port + 1)], args.port + 1,
                      args.out_dir)
        procs.append(target)
        scorer = Proc("scorer", [*serve, "--model", SCORER, "--port", str(args.port + 2)], args.port + 2,
                      args.out_dir)
        procs.append(scorer)
        config = {"models": {"target": {"upstreams": [target.url], "upstream_model": args.target,
                                        "compress": {"scorer": "scorer", "rate": 0.5, "min_tokens": 200}},
                             "scorer": {"upstreams": [scorer.url], "upstream_model": SCORER}},
                  "cache": {"exact": False}}
        config_path = args.out_dir / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(config))
        procs.append(Proc("gateway", [sys.executable, "-m", "llmserve.cli", "gateway", "--config", str(config_path),
                                      "--port", str(args.port), "--no-access-log"], args.port, args.out_dir))
        started = time.perf_counter()
        rows = asyncio.run(run(args, f"http://127.0.0.1:{args.port}", scorer.url))
        seconds = time.perf_counter() - started
    finally:
        for proc in reversed(procs):
            proc.stop()
    summary = summarise(rows)
    doc = {"task": "quoref (BIG-bench natural_instructions subtask002)", "target": args.target, "scorer": SCORER,
           "rates": args.rates, "min_words": args.min_words, "max_tokens": args.max_tokens, "machine": facts,
           "seconds": round(seconds), "summary": summary, "rows": rows}
    (args.out_dir / "quoref.json").write_text(json.dumps(doc, indent=1))
    report = markdown(summary, rows, facts, args, seconds)
    (args.out_dir / "quoref.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
