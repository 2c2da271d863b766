"""What a piece of work the step no longer does costs a batch-1 step, on the caches a step leaves: stretches of the
step as built (A) and with that work put back (B), alternated in one process, so that the host's state moves under
both alike. The work (argument): `python-ops`, the Python ops the one native call now does itself (the embedding,
the rotary rows, the final norm); `float-logits`, the head's output copied to float32 before a greedy argmax.

    python benchmarks/results/step-rest-s55/paired_variants.py python-ops|float-logits [rounds]
"""

from __future__ import annotations

import sys

from steady import alternate, decoding_engine

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


def use(variant: str) -> None:
    setattr(model, name, plain if variant == "A" else put_back)


print(f"{work}: {alternate(engine, use, int(sys.argv[2]) if len(sys.argv) > 2 else 38)}")
