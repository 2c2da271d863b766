"""The check every engine mode owes: greedy tokens equal a reference, batched and alone, all KV freed."""

from __future__ import annotations

from llmserve import LLM, SamplingParams


def assert_greedy_equals(llm: LLM, prompts: list[list[int]], expected: list[list[int]], single: int = 0) -> None:
    """Batched (decodes share steps) and prompt `single` alone (every decode step is one token)."""
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    [alone] = llm.generate([prompts[single]], params, use_tqdm=False)
    assert alone.outputs[0].token_ids == expected[single]
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
