"""Which model class runs which Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from llmserve.models.llama import LlamaConfig, LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # Llama with q/k/v bias (LlamaConfig.attention_bias)
}


def model_class(cfg: LlamaConfig) -> type[nn.Module]:
    try:
        return _ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; supported: {sorted(_ARCHITECTURES)}"
        ) from None
