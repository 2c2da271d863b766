"""transformers as the reference implementation: the same checkpoint run by transformers' own code.

Tests compare our greedy tokens against it; benchmarks use it as the naive and static-batching
baselines. It loads GGUF files with transformers' own dequantization, so it checks our loader too.
"""

from __future__ import annotations

import os

import torch

from llmserve.loader.default_models import resolve_model_path


def reference_model(model: str | None = None, dtype: torch.dtype = torch.float32):
    """A transformers `AutoModelForCausalLM` for a registered name, GGUF file or HF directory."""
    from transformers import AutoModelForCausalLM

    path, _ = resolve_model_path(model)
    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    from transformers import GgufConfig

    folder, filename = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    ).eval()


def quantized_reference(model, method: str):
    """A copy of a transformers Llama model whose linear weights are exactly the values llmserve's
    `--quantization method` computes with (the output head int8, untied from the embedding)."""
    import copy

    from torch import nn

    from llmserve.quantization.weight_only import WeightOnlyLinear

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for module in ref.model.layers.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(WeightOnlyLinear(module.weight, method).weight)
        head = WeightOnlyLinear(ref.model.embed_tokens.weight, "int8").weight
        ref.lm_head.weight = nn.Parameter(head.clone())
    return ref


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache and no logits processors (EOS is not special)."""
    out_ids: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            out_ids.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids
