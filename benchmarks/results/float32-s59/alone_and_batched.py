"""A float32 dense engine's greedy tokens and logprobs for one request alone and beside two others (session 59):
the README's "Reproducibility" claim, measured (SmolLM2, 24 tokens, a short and a 225-token prompt). `--pad`: a probe
that computes a lone row's products as two rows (oneDNN rounds two or more rows alike, one on its own way).

    .venv/bin/python benchmarks/results/float32-s59/alone_and_batched.py [--pad]
"""

from __future__ import annotations

import sys

import torch

import llmserve.layers.linear as linear
from llmserve import LLM, SamplingParams

OTHERS = ["Write a poem about the sea and the sky above it, in four lines.", "def fib(n):"]


def pad_lone_rows() -> None:
    plain = linear.dense_linear

    def padded(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and layer.packed is not None:
            return plain(layer, torch.cat([x, x]))[:1]
        return plain(layer, x)

    linear.dense_linear = padded


def main() -> None:
    torch.set_num_threads(2)
    if "--pad" in sys.argv:
        pad_lone_rows()
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_model_len=2048,
              speculative_config="off")
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
    for prompt in ["The history of the Roman empire", " ".join(["The history of the Roman empire is long."] * 25)]:
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        batched = llm.generate([prompt, *OTHERS], params, use_tqdm=False)[0].outputs[0]
        pairs = [(a[t].logprob, b[t].logprob) for a, b in zip(alone.logprobs, batched.logprobs, strict=True)
                 for t in a if t in b]
        print(f"prompt of {len(llm.get_tokenizer().encode(prompt))} tokens: same tokens "
              f"{alone.token_ids == batched.token_ids}, logprobs equal to the bit "
              f"{sum(a == b for a, b in pairs)} of {len(pairs)}, largest difference "
              f"{max(abs(a - b) for a, b in pairs):.1e}", flush=True)


if __name__ == "__main__":
    main()
