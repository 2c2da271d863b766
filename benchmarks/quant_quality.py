"""Quality of weight-only quantization: perplexity and greedy agreement against the unquantized weights.

    .venv/bin/python benchmarks/quant_quality.py            # the embedded model, fp32 compute

Each variant is transformers' model with its linear weights replaced by exactly the values our
`WeightOnlyLinear` computes with (its dequantized weight; output head int8), so the figures are those
of the weights `llmserve serve --quantization ...` serves. Text: this repository's README files
(fixed, in the repo), scored in windows of 512 tokens. Agreement: the share of the first 32 greedy
tokens equal to the unquantized model's, over the test prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import PROMPT_TEXTS  # noqa: E402

from llmserve import LLM  # noqa: E402
from llmserve.evaluate.reference import (  # noqa: E402
    int8_activation_reference,
    quantized_reference,
    reference_greedy,
    reference_model,
)
from llmserve.loader import load_checkpoint  # noqa: E402


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]])
        logits = model(chunk[:, :-1]).logits.float()
        nll += nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quant_quality.json")
    args = ap.parse_args()
    tokenizer = load_checkpoint(None).tokenizer
    text = "\n\n".join((REPO / p).read_text() for p in ("README.md", "benchmarks/README.md"))
    ids = tokenizer.encode(text)
    prompts = [tokenizer.encode(p) for p in PROMPT_TEXTS]
    base = reference_model(None, torch.float32)
    baseline_tokens = None
    rows = []
    for method in (None, "int8", "int4", "int4 + int8 activations"):
        start = time.perf_counter()
        if method is None:
            model = base
        elif method.endswith("int8 activations"):  # the served layers after calibration, on every step
            served = LLM(dtype="float32", quantization="int4", int8_activations=True, kv_cache_memory_gb=0.1)
            model = int8_activation_reference(base, served.engine.runner.model, "int4", max_tokens=0)
        else:
            model = quantized_reference(base, method)
        ppl = perplexity(model, ids, args.window)
        tokens = [reference_greedy(model, p, 32) for p in prompts]
        baseline_tokens = baseline_tokens or tokens
        same = sum(a == b for x, y in zip(tokens, baseline_tokens, strict=True) for a, b in zip(x, y, strict=True))
        rows.append({"weights": method or "unquantized (Q4_1 dequantized)", "perplexity": ppl,
                     "greedy_agreement": same / sum(len(t) for t in tokens)})
        print(f"{rows[-1]['weights']}: perplexity {ppl:.3f}, greedy agreement {rows[-1]['greedy_agreement']:.1%} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    args.out.write_text(json.dumps({"text_tokens": len(ids), "window": args.window, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
