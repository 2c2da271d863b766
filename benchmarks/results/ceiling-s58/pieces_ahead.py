"""Per-piece times of the fused decode stack with the attention's K/V walker prefetching N blocks ahead, for each
N given, stretches of 32 batch-1 steps alternated in one process (session 58, issue 20). Probe build as in
`pieces_team.py`:
    PYTHONPATH=/tmp/probe LLMSERVE_CACHE=/tmp/cache-probe python benchmarks/results/ceiling-s58/pieces_ahead.py 10 4,8,2
"""

from __future__ import annotations

import sys

import torch
from pieces_team import core_probes, decoding_engine, print_medians, timed_stretches

if __name__ == "__main__":
    llm, engine = decoding_engine()
    probe = core_probes()
    variants = [int(v) for v in sys.argv[2].split(",")]
    names, rows = timed_stretches(engine, torch.ops.llmserve.probe_ahead, variants, int(sys.argv[1]))
    print("state", probe(), "context", engine.requests["probe"].num_computed_tokens)
    print_medians(names, rows, variants, [f"{v}:" for v in variants])
