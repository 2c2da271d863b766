"""torch.compile'd decoder layers: the same greedy tokens as transformers, in batched and single steps."""

from __future__ import annotations

from llmserve import LLM
from tests.greedy import assert_greedy_equals


def test_compiled_layers_match_transformers(prompt_token_ids, hf_reference):
    llm = LLM(dtype="float32", compile=True, kv_cache_memory_gb=0.25, max_model_len=2048)
    # the warm-up ran before serving and left nothing behind
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    assert llm.engine.kv_cache.stats.queries == 0
    assert_greedy_equals(llm, prompt_token_ids, hf_reference, single=2)
