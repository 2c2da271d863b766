"""The engine's one-request decode step with the fused stack timed piece by piece, at a few context lengths: us a
layer for each piece (`bandwidth_ceiling.piece_split`: best of 4 stretches of 16 steps).

    .venv/bin/python benchmarks/results/attention-runs-s45/stack_pieces.py --contexts 256,1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[3]), help="the checkout to load")
    parser.add_argument("--contexts", default="32,256,1024")
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    sys.path.insert(0, str(Path(args.root) / "benchmarks"))
    import torch
    from bandwidth_ceiling import piece_split

    from llmserve import LLM, SamplingParams

    engine = LLM(None, speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096).engine
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(3, engine.model_config.vocab_size, (context,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        rid = f"context-{context}"
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
        while engine.requests[rid].num_computed_tokens < len(prompt):
            engine.step()
        for _ in range(4):
            engine.step()
        print(f"\n{context} tokens of context:")
        piece_split(engine, steps=16, repeats=4)
        engine.abort_request(rid)


if __name__ == "__main__":
    main()
