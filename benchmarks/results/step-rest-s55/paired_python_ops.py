"""What the Python ops the one native call now does itself (the embedding, the rotary rows, the final norm) cost a
batch-1 step, on the caches a step leaves: stretches of the step as built (A) and with those ops run again beside
the call (B), alternated in one process, so that the host's state moves under both alike.

    python benchmarks/results/step-rest-s55/paired_python_ops.py
"""

from __future__ import annotations

import statistics
import time

import torch

from llmserve import LLM, SamplingParams

torch.set_num_threads(2)
llm = LLM(speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096)
engine = llm.engine
model = engine.runner.model
plain = model.forward_fused


def with_python_ops(stack, input_ids, positions, meta):
    x = model.embed_tokens(input_ids)
    model.rotary.lookup(positions, x.dtype)
    return model.norm(plain(stack, input_ids, positions, meta))


vocab = engine.model_config.vocab_size
prompt = torch.randint(3, vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist()
engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=3800, ignore_eos=True))
while engine.requests["probe"].num_computed_tokens < len(prompt):
    engine.step()
for _ in range(16):
    engine.step()
steps, diffs, built, with_ops = 48, [], [], []
for r in range(38):
    times = {}
    for variant in ("A", "B") if r % 2 == 0 else ("B", "A"):
        model.forward_fused = plain if variant == "A" else with_python_ops
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times[variant] = (time.perf_counter() - start) / steps * 1e3
    diffs.append(times["B"] - times["A"])
    built.append(times["A"])
    with_ops.append(times["B"])
print(f"A {statistics.median(built):.3f} ms, B {statistics.median(with_ops):.3f} ms, B-A median "
      f"{statistics.median(diffs) * 1e3:.0f} us, mean {statistics.mean(diffs) * 1e3:.0f} us, quartiles "
      f"{[round(q * 1e3) for q in statistics.quantiles(diffs, n=4)]}")
