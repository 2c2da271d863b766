"""The fused stack's attention piece (us a layer) at several contexts: one batch-1 request per context, decoding,
timed stretches alternated across the contexts in one process (session 59, issue 20). Separates the piece's fixed
cost from its cost per token of context."""

from __future__ import annotations

import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "step-rest-s55"))
sys.path.insert(0, str(HERE.parents[1]))
from bandwidth_ceiling import core_probes, timed_stretch  # noqa: E402
from steady import decoding_engine  # noqa: E402  (session 55's probe engine)


def main(contexts: list[int], rounds: int, steps: int = 32) -> None:
    probe = core_probes()
    print("state before", probe(), flush=True)
    engines = {ctx: decoding_engine(max_tokens=2000, prompt_tokens=ctx) for ctx in contexts}
    layers = len(engines[contexts[0]][1].runner.model.layers)
    rows: dict[int, list] = {c: [] for c in contexts}
    names: list[str] = []
    for r in range(rounds):
        for ctx in contexts if r % 2 == 0 else contexts[::-1]:
            engine = engines[ctx][1]
            step, timed = timed_stretch(engine, steps)
            names = list(timed.pieces)
            rows[ctx].append([s / steps / layers * 1e6 for s in timed.seconds.tolist()] + [step * 1e3])
    print("state after", probe())
    names.append("step ms")
    print(f"{'piece':18s} " + "  ".join(f"ctx~{c:5d}" for c in contexts))
    for i, name in enumerate(names):
        print(f"{name:18s} " + "  ".join(f"{statistics.median(x[i] for x in rows[c]):9.2f}" for c in contexts))


if __name__ == "__main__":
    main([int(c) for c in sys.argv[2].split(",")], int(sys.argv[1]))
