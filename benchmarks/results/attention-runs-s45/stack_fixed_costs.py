"""The fused decode stack's fixed costs: a small Llama (30 layers, hidden 256, random weights, int4) whose weights
stay in cache, one request, each piece of a layer timed (`bandwidth_ceiling.piece_split`: best of 8 stretches of
32 steps).

    .venv/bin/python benchmarks/results/attention-runs-s45/stack_fixed_costs.py [--root CHECKOUT]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

SHAPE = dict(kind="llama", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=30,
             num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[3]), help="the checkout to load")
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    sys.path.insert(0, str(Path(args.root) / "benchmarks"))
    import device_throughput
    from bandwidth_ceiling import piece_split

    from llmserve import LLM, SamplingParams

    device_throughput.SHAPES["small"] = SHAPE
    with tempfile.TemporaryDirectory() as folder:
        path = device_throughput.build("small", Path(folder))
        llm = LLM(path, device="cpu", quantization="int4", speculative_config="off", kv_cache_memory_gb=0.2,
                  max_model_len=1024)
    engine = llm.engine
    assert engine.runner.fused_stack is not None, "the fused stack must run this model's decode steps"
    engine.add_request("r", list(range(3, 67)), SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
    while engine.requests["r"].num_computed_tokens < 64:
        engine.step()
    for _ in range(20):
        engine.step()
    rows = piece_split(engine, steps=32, repeats=8)
    print(f"all pieces: {sum(row['us_a_layer'] for row in rows):.2f} us a layer")


if __name__ == "__main__":
    main()
