"""What a piece of work the step no longer does costs a batch-1 step, on the caches a step leaves: stretches of the
step as built (A) and with that work put back (B), alternated in one process, so that the host's state moves under
both alike. The work (argument): `python-ops`, the Python ops the one native call now does itself (the embedding,
the rotary rows, the final norm); `float-logits`, the head's output copied to float32 before a greedy argmax.

    python benchmarks/results/step-rest-s55/paired_variants.py python-ops|float-logits
"""

from __future__ import annotations

import statistics
import sys
import time

from steady import decoding_engine

llm, engine = decoding_engine(3800)
model = engine.runner.model
work = sys.argv[1] if len(sys.argv) > 1 else "python-ops"
name = {"python-ops": "forward_fused", "float-logits": "compute_logits"}[work]
plain = getattr(model, name)


def with_python_ops(stack, input_ids, positions, meta):
    x = model.embed_tokens(input_ids)
    model.rotary.lookup(positions, x.dtype)
    return model.norm(plain(stack, input_ids, positions, meta))


def with_float_logits(hidden, as_float=True):
    return plain(hidden, as_float=True)


put_back = with_python_ops if work == "python-ops" else with_float_logits


steps, diffs, built, with_ops = 48, [], [], []
for r in range(38):
    times = {}
    for variant in ("A", "B") if r % 2 == 0 else ("B", "A"):
        setattr(model, name, plain if variant == "A" else put_back)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times[variant] = (time.perf_counter() - start) / steps * 1e3
    diffs.append(times["B"] - times["A"])
    built.append(times["A"])
    with_ops.append(times["B"])
print(f"{work}: A {statistics.median(built):.3f} ms, B {statistics.median(with_ops):.3f} ms, B-A median "
      f"{statistics.median(diffs) * 1e3:.0f} us, mean {statistics.mean(diffs) * 1e3:.0f} us, quartiles "
      f"{[round(q * 1e3) for q in statistics.quantiles(diffs, n=4)]}")
