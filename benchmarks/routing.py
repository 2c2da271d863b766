"""Model routing on held-out HumanEval problems (issue 24): quality against the share of strong-model calls.

    llmserve eval qwen2.5-coder-0.5b --tasks humaneval --out benchmarks/results/routing/humaneval_qwen0.5b.json
    llmserve eval qwen2.5-coder-1.5b --tasks humaneval --out benchmarks/results/routing/humaneval_qwen1.5b.json
    llmserve serve qwen2.5-coder-0.5b --port 8000 &        # the judge
    python -m llmserve.gateway.routing.train judge --weak benchmarks/results/routing/humaneval_qwen0.5b.json \\
        --base-url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b --out benchmarks/results/routing/judge.json
    python benchmarks/routing.py

Learned routers: "learned" predicts that the weak model fails, "learned-wins" that the strong model wins (the
weak one fails and the strong one passes); "length" sends the longest requests to the strong model (a baseline
that needs no model). Every problem is scored by a router that never saw it: the learned
routers are trained in k folds (each fold's problems scored by the classifier fitted on the others), and every
router's threshold is calibrated on the training folds' scores only, as a deployed router calibrates on data
it has. Quality at a share s of strong
calls is pass@1 when each problem is answered by the model its router chose (both models' answers are
measured, greedy). RouteLLM's measures: PGR(s) = (q(s) - q_weak) / (q_strong - q_weak), APGR its mean over
s in 0, 0.1, ..., 1 (trapezoids); random routing's APGR is 0.5 in expectation. Confidence intervals: the
problems resampled (bootstrap, 1000 draws), routers' decisions kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve.gateway.routing.learned import fit_logistic, out_of_fold_scores, predict  # noqa: E402
from llmserve.gateway.routing.router import threshold_for_share  # noqa: E402
from llmserve.gateway.routing.train import humaneval_outcomes  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "routing"
SHARES = np.round(np.linspace(0.0, 1.0, 11), 2)


def learned_held_out(features: np.ndarray, labels: np.ndarray, folds: np.ndarray, l2: float,
                     shares: np.ndarray) -> np.ndarray:
    """[len(shares), n] bool: strong or not, each problem decided by a router trained without its fold."""
    strong = np.zeros((len(shares), len(labels)), dtype=bool)
    for fold in np.unique(folds):
        test, train = folds == fold, folds != fold
        weights, bias = fit_logistic(features[train], labels[train], l2)
        calibration = out_of_fold_scores(features[train], labels[train], l2).tolist()  # as `train.py` writes it
        scores = predict(weights, bias, features[test])
        for i, share in enumerate(shares):
            strong[i, test] = scores > threshold_for_share(calibration, share)
    return strong


def scored_held_out(scores: np.ndarray, folds: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """The same for a router with fixed scores (the judge): thresholds from the other folds' scores."""
    strong = np.zeros((len(shares), len(scores)), dtype=bool)
    for fold in np.unique(folds):
        test = folds == fold
        calibration = scores[~test].tolist()
        for i, share in enumerate(shares):
            strong[i, test] = scores[test] > threshold_for_share(calibration, share)
    return strong


def apgr(quality: np.ndarray, q_weak: float, q_strong: float, shares: np.ndarray) -> float:
    pgr = (quality - q_weak) / (q_strong - q_weak)
    return float(np.trapezoid(pgr, shares) / (shares[-1] - shares[0]))


def curve(strong: np.ndarray, weak_pass: np.ndarray, strong_pass: np.ndarray, idx: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """(quality, actual strong share) per share level, over the problems `idx` (a bootstrap draw)."""
    chosen = strong[:, idx]
    quality = np.where(chosen, strong_pass[idx], weak_pass[idx]).mean(axis=1)
    return quality, chosen.mean(axis=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weak", type=Path, default=RESULTS / "humaneval_qwen0.5b.json")
    parser.add_argument("--strong", type=Path, default=RESULTS / "humaneval_qwen1.5b.json")
    parser.add_argument("--judge", type=Path, default=RESULTS / "judge.json",
                        help="the judge router's file (its calibration scores: one per problem, in order)")
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="fold splits (seeds) the learned router is run on")
    parser.add_argument("--l2", type=float, default=1.0)
    parser.add_argument("--bootstrap", type=int, default=1000)
    # $ per 1M output tokens (input tokens at a quarter of it); default: proportional to parameters, the
    # self-hosted cost on bandwidth-bound hardware. Give an API's prices to see its economics.
    parser.add_argument("--weak-price", type=float, default=0.05)
    parser.add_argument("--strong-price", type=float, default=0.15)
    parser.add_argument("--tokenizer", default="qwen2.5-coder-0.5b", help="counts tokens for the cost columns")
    parser.add_argument("--out", type=Path, default=RESULTS / "routing")
    args = parser.parse_args()

    weak, strong_outcomes = humaneval_outcomes(args.weak), humaneval_outcomes(args.strong)
    if [o.task_id for o in weak] != [o.task_id for o in strong_outcomes]:
        raise SystemExit("the two result files hold different problems")
    texts = [o.text for o in weak]
    weak_pass = np.array([o.passed for o in weak], dtype=float)
    strong_pass = np.array([o.passed for o in strong_outcomes], dtype=float)
    q_weak, q_strong = weak_pass.mean(), strong_pass.mean()
    n = len(texts)
    print(f"{n} problems: weak pass@1 {q_weak:.3f}, strong {q_strong:.3f}; weak fails and strong passes on "
          f"{int(((1 - weak_pass) * strong_pass).sum())}, weak passes and strong fails on "
          f"{int((weak_pass * (1 - strong_pass)).sum())}")

    from llmserve.gateway.embedder import Embedder

    embedder = Embedder()
    features = embedder.embed(texts).astype(np.float64)
    embedder.close()
    labels = 1.0 - weak_pass

    wins = (1 - weak_pass) * strong_pass  # RouteLLM's label: the strong model wins
    decisions: dict[str, list[np.ndarray]] = {"learned": [], "learned-wins": []}
    judge_scores = None
    if args.judge.exists():
        judge_scores = np.asarray(json.loads(args.judge.read_text())["calibration_scores"], dtype=float)
        decisions["judge"] = []
    # a baseline that needs no model: longer requests to the strong model
    decisions["length"] = []
    lengths = np.array([len(t) for t in texts], dtype=float)
    rng = np.random.default_rng(0)
    for repeat in range(args.repeats):
        folds = np.random.default_rng(repeat).permutation(n) % args.folds
        decisions["learned"].append(learned_held_out(features, labels, folds, args.l2, SHARES))
        decisions["learned-wins"].append(learned_held_out(features, wins, folds, args.l2, SHARES))
        if judge_scores is not None:
            decisions["judge"].append(scored_held_out(judge_scores, folds, SHARES))
        decisions["length"].append(scored_held_out(lengths, folds, SHARES))
    # random routing at each share: every problem strong with probability s, many draws
    decisions["random"] = [rng.random((len(SHARES), n)) < SHARES[:, None] for _ in range(args.repeats * 20)]
    # the oracle: strong exactly where the weak model fails and the strong one passes (a bound, not a router)
    order = np.argsort(-wins + rng.random(n) * 1e-6)
    decisions["oracle"] = [np.stack([np.isin(np.arange(n), order[: round(s * n)]) for s in SHARES])]

    # tokens per request and answer, for cost (both models share Qwen2.5's tokenizer); an answer is counted as
    # the code `llmserve eval` kept of it (the prose around a code block is not kept, so this undercounts)
    from llmserve.loader import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    out_tokens = {"weak": np.array([count(r["completion"]) for r in _results(args.weak)], dtype=float),
                  "strong": np.array([count(r["completion"]) for r in _results(args.strong)], dtype=float)}
    in_tokens = np.array([count(t) for t in texts], dtype=float)

    def cost(strong: np.ndarray) -> np.ndarray:
        per = {k: (in_tokens * p / 4 + out_tokens[k] * p) / 1e6
               for k, p in (("weak", args.weak_price), ("strong", args.strong_price))}
        return np.where(strong, per["strong"], per["weak"]).sum(axis=-1)

    report: dict = {"problems": n, "weak_pass_at_1": q_weak, "strong_pass_at_1": q_strong, "shares": SHARES.tolist(),
                    "folds": args.folds, "repeats": args.repeats, "prices_per_million_output": {
                        "weak": args.weak_price, "strong": args.strong_price}, "routers": {}}
    all_idx = np.arange(n)
    boot = [rng.integers(0, n, n) for _ in range(args.bootstrap)]
    for name, runs in decisions.items():
        qualities, shares_actual = np.mean([curve(d, weak_pass, strong_pass, all_idx) for d in runs], axis=0)
        # bootstrap: resample problems; the quality curve is averaged over the runs (splits / draws)
        apgrs = []
        for idx in boot:
            qw, qs = weak_pass[idx].mean(), strong_pass[idx].mean()
            if qs == qw:
                continue
            q = np.mean([curve(d, weak_pass, strong_pass, idx)[0] for d in runs[:5]], axis=0)
            apgrs.append(apgr(q, qw, qs, SHARES))
        costs = np.mean([cost(d) for d in runs], axis=0)
        solved = qualities * n
        report["routers"][name] = {
            "quality": qualities.tolist(), "strong_share_actual": shares_actual.tolist(),
            "apgr": apgr(qualities, q_weak, q_strong, SHARES),
            "apgr_ci95": [float(np.percentile(apgrs, 2.5)), float(np.percentile(apgrs, 97.5))],
            "cost_per_solved": (costs / np.maximum(solved, 1)).tolist()}
    # the paired difference against random, on the same resampled problems
    for name in [k for k in decisions if k not in ("random", "oracle")]:
        diffs = []
        for idx in boot:
            qw, qs = weak_pass[idx].mean(), strong_pass[idx].mean()
            if qs == qw:
                continue
            a = np.mean([curve(d, weak_pass, strong_pass, idx)[0] for d in decisions[name][:5]], axis=0)
            b = np.mean([curve(d, weak_pass, strong_pass, idx)[0] for d in decisions["random"][:20]], axis=0)
            diffs.append(apgr(a, qw, qs, SHARES) - apgr(b, qw, qs, SHARES))
        report["routers"][name]["apgr_minus_random_ci95"] = [float(np.percentile(diffs, 2.5)),
                                                             float(np.percentile(diffs, 97.5))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1))
    Path(f"{args.out}.md").write_text(table(report))
    plot(report, Path(f"{args.out}.png"))
    print(table(report))
    return 0


def _results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["tasks"]["humaneval"]["results"]


def table(report: dict) -> str:
    routers = report["routers"]
    names = list(routers)
    lines = [f"HumanEval, {report['problems']} problems held out ({report['folds']}-fold, {report['repeats']} splits); "
             f"weak pass@1 {report['weak_pass_at_1']:.3f}, strong {report['strong_pass_at_1']:.3f}", "",
             "| strong share | " + " | ".join(f"{n} pass@1" for n in names) + " | "
             + " | ".join(f"{n} µ$/solved" for n in names if n != "oracle") + " |",
             "|---:|" + "---:|" * (2 * len(names) - 1)]
    for i, share in enumerate(report["shares"]):
        cells = [f"{routers[n]['quality'][i]:.3f}" for n in names]
        cells += [f"{routers[n]['cost_per_solved'][i] * 1e6:.1f}" for n in names if n != "oracle"]
        lines.append(f"| {share:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "| router | APGR | 95 % CI | APGR - random, 95 % CI |", "|---|---:|---:|---:|"]
    for n in names:
        r = routers[n]
        diff = r.get("apgr_minus_random_ci95")
        lines.append(f"| {n} | {r['apgr']:.3f} | {r['apgr_ci95'][0]:.3f} .. {r['apgr_ci95'][1]:.3f} | "
                     + (f"{diff[0]:+.3f} .. {diff[1]:+.3f}" if diff else "-") + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in report["routers"].items():
        style = {"random": "k--", "oracle": "g:"}.get(name, "-o")
        ax.plot(report["shares"], r["quality"], style, label=f"{name} (APGR {r['apgr']:.2f})")
    ax.set_xlabel("share of requests sent to the strong model")
    ax.set_ylabel("HumanEval pass@1 (held out)")
    ax.set_title("Routing qwen2.5-coder 0.5B / 1.5B")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
