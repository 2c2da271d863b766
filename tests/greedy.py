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


def assert_equal_up_to_a_near_tie(fast, plain, margin: float = 0.25) -> None:
    """`fast`'s greedy tokens are `plain`'s, or part from them where `plain`'s best two candidates nearly tie (in
    bfloat16 a verification step, whose rows split the attention otherwise, can round the last bits apart, as a
    batch can: README, Reproducibility). Nearly: within two units in the last place of a bfloat16 logit below 32
    (0.125 each), the finest gap the logits can show; a gap of exactly one unit was seen to part them."""
    for i, (a, b) in enumerate(zip(fast.token_ids, plain.token_ids, strict=True)):
        if a != b:
            best, second = sorted((p.logprob for p in plain.logprobs[i].values()), reverse=True)[:2]
            assert best - second < margin, (f"greedy tokens part at {i} where the reference does not nearly tie "
                                            f"({best - second:.4f})")
            return
