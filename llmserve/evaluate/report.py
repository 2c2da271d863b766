"""`llmserve eval`'s tables: one run's results, and two runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

# (task, key, label, format); higher is better unless `lower` is True
METRICS = [
    ("perplexity", "perplexity", "perplexity", "{:.4f}", True),
    ("perplexity", "tokens", "tokens scored", "{:d}", None),
    ("humaneval", "pass_at_1", "HumanEval pass@1", "{:.3f}", False),
    ("humaneval", "passed", "HumanEval passed", "{:d}", None),
    ("humaneval", "problems", "HumanEval problems", "{:d}", None),
    ("agreement", "exact", "greedy outputs identical", "{:.3f}", False),
    ("agreement", "token_agreement", "tokens before divergence", "{:.3f}", False),
    ("agreement", "first_divergence_mean", "first divergence (mean pos)", "{:.1f}", False),
    ("agreement", "cosine_mean", "MiniLM cosine (mean)", "{:.4f}", False),
    ("agreement", "cosine_min", "MiniLM cosine (min)", "{:.4f}", False),
]


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def results_table(result: dict) -> str:
    lines = [f"| {result['label']} | |", "|---|---:|"]
    for task, key, label, fmt, _ in METRICS:
        value = result["tasks"].get(task, {}).get(key)
        if value is not None:
            lines.append(f"| {label} | {fmt.format(value)} |")
    return "\n".join(lines)


def compare_table(a: dict, b: dict) -> str:
    lines = [f"| metric | {a['label']} | {b['label']} | B - A |", "|---|---:|---:|---:|"]
    for task, key, label, fmt, lower in METRICS:
        va, vb = a["tasks"].get(task, {}).get(key), b["tasks"].get(task, {}).get(key)
        if va is None and vb is None:
            continue
        cells = [fmt.format(v) if v is not None else "-" for v in (va, vb)]
        delta = ""
        if va is not None and vb is not None and lower is not None:
            diff = vb - va
            rel = f" ({diff / va:+.2%})" if va else ""
            delta = f"{diff:+.4g}{rel}"
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {delta} |")
    return "\n".join(lines)
