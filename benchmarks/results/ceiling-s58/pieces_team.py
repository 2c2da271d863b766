"""Per-piece times of the fused decode stack with the team held (B) and with a fork and join per piece (A),
stretches of 32 batch-1 steps alternated in one process (session 58, issue 20).

Needs a probe build with the switches of `probe_switches.patch` (not in the committed code):
    git worktree add /tmp/probe HEAD
    (cd /tmp/probe && git apply $OLDPWD/benchmarks/results/ceiling-s58/probe_switches.patch)
    PYTHONPATH=/tmp/probe LLMSERVE_CACHE=/tmp/cache-probe python benchmarks/results/ceiling-s58/pieces_team.py 12
"""

from __future__ import annotations

import pathlib
import statistics
import sys

import torch

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "step-rest-s55"))
sys.path.insert(0, str(HERE.parents[1]))
from bandwidth_ceiling import core_probes, timed_stretch  # noqa: E402
from steady import decoding_engine  # noqa: E402  (session 55's probe engine)


def timed_stretches(engine, use, variants: list, rounds: int, steps: int = 32) -> tuple[list[str], dict]:
    """The pieces' names (and "step ms"), and for each variant, per stretch, each piece's us a layer and the step's
    ms; the variants' order reversed each round."""
    layers = len(engine.runner.model.layers)
    rows: dict = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            use(v)
            step, timed = timed_stretch(engine, steps)
            rows[v].append([s / steps / layers * 1e6 for s in timed.seconds.tolist()] + [step * 1e3])
    return list(timed.pieces) + ["step ms"], rows


def print_medians(names: list[str], rows: dict, variants: list, labels: list[str]) -> None:
    for i, name in enumerate(names):
        cells = "  ".join(f"{label} {statistics.median(x[i] for x in rows[v]):8.2f}"
                          for v, label in zip(variants, labels, strict=True))
        print(f"{name:18s} {cells}")


if __name__ == "__main__":
    llm, engine = decoding_engine()
    probe = core_probes()
    names, rows = timed_stretches(engine, lambda v: torch.ops.llmserve.probe_team(v == "B"), ["A", "B"],
                                  int(sys.argv[1]))
    print("state", probe())
    print_medians(names, rows, ["A", "B"], ["fork/join", "team"])
