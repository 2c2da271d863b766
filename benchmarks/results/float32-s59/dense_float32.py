"""A dense float32 model's decode steps with its linears on oneDNN's packed product (this session's default) against
MKL's `F.linear` (before): two engines in one process, generate() alternated, the order swapped each round
(session 59). Float32 is the model dtype where a CPU runs no bfloat16 (AVX2-only hosts), so an unquantized model
served there takes these products.

    .venv/bin/python benchmarks/results/float32-s59/dense_float32.py [--model NAME] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

import llmserve.layers.linear as linear
from llmserve import LLM, SamplingParams

PACKS = linear.packs


def mkl_only(weight: torch.Tensor) -> bool:
    """The rule before this session: float32 packs only a quantized layer's weight (none in a dense model)."""
    return weight.dtype == torch.bfloat16 and PACKS(weight)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    common = {"dtype": "float32", "quantization": "none", "speculative_config": "off", "kv_cache_memory_gb": 0.25,
              "max_model_len": 1024}
    engines = {"oneDNN packed": LLM(args.model, **common)}
    with mock.patch.object(linear, "packs", mkl_only):
        engines["MKL F.linear"] = LLM(args.model, **common)
    prompt = torch.randint(3, 30000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for batch in (1, 4, 16):
        prompts = [[(t + i) % 30000 + 3 for t in prompt] for i in range(batch)]
        rates: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                start = time.perf_counter()
                outs = engines[name].generate(prompts, params, use_tqdm=False)
                rates[name].append(batch * args.tokens / (time.perf_counter() - start))
                tokens[name] = [o.outputs[0].token_ids for o in outs]
        same = tokens["oneDNN packed"] == tokens["MKL F.linear"]
        cells = "  ".join(f"{name} {statistics.median(v):7.1f} tok/s" for name, v in rates.items())
        ratio = statistics.median(rates["oneDNN packed"]) / statistics.median(rates["MKL F.linear"])
        print(f"batch {batch:2d}: {cells}  x{ratio:.2f}  same greedy tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
