"""The probes' engine: the default model (SmolLM2) as served, one request decoding after a 256-token prompt."""

from __future__ import annotations

import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.llm_engine import LLMEngine


def decoding_engine(max_tokens: int = 3500) -> tuple[LLM, LLMEngine]:
    """Two threads, speculation off; returns once the prompt is computed and 16 tokens decoded."""
    torch.set_num_threads(2)
    llm = LLM(speculative_config="off", kv_cache_memory_gb=0.5, max_model_len=4096)
    engine = llm.engine
    prompt = torch.randint(3, engine.model_config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    engine.add_request("probe", prompt.tolist(), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.requests["probe"].num_computed_tokens < len(prompt):
        engine.step()
    for _ in range(16):
        engine.step()
    return llm, engine
