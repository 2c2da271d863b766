"""The decode stack holding torch's threads as one team (B) against a fork and join per product and attention (A):
stretches of batch-1 steps alternated in one process, so that the host's state moves under both alike; each run's
line says the core round trip before and after it (~50 ns: a shared L3, ~330 ns: the cores on two dies).

Needs a probe build: `kernels/decode_layer.cpp` with a switch the committed code does not have, e.g.
    inline bool g_probe_team = true;                       // beside LayerOps
    if (tokens <= small_max_tokens_ && g_probe_team)       // in run_typed
    m.def("probe_team(bool on) -> ()", [](bool on) { g_probe_team = on; });   // in TORCH_LIBRARY_FRAGMENT

    python benchmarks/results/team-s57/paired_team.py RUNS ROUNDS      (paired_team.log: 10 20, and 8 20)
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "step-rest-s55"))
sys.path.insert(0, str(pathlib.Path(__file__).parents[2]))
from bandwidth_ceiling import core_probes  # noqa: E402
from steady import alternate, decoding_engine  # noqa: E402  (session 55's probe engine)

from llmserve import SamplingParams  # noqa: E402

llm, engine = decoding_engine()
probe = core_probes()


def use(variant: str) -> None:
    torch.ops.llmserve.probe_team(variant == "B")


for run in range(int(sys.argv[1])):
    before = probe()
    line = alternate(engine, use, rounds=int(sys.argv[2]), steps=32)
    print(f"run {run} state {before[0]}->{probe()[0]} ns: {line}", flush=True)
    if engine.requests["probe"].num_computed_tokens > 1500:  # contexts of 256-1500 tokens
        engine.abort_request("probe")
        vocab = engine.model_config.vocab_size
        prompt = torch.randint(3, vocab, (256,), generator=torch.Generator().manual_seed(run)).tolist()
        engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=3500, ignore_eos=True))
        for _ in range(24):
            engine.step()
