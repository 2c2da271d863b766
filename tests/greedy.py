"""The check every engine mode owes: greedy tokens equal a reference, batched and alone, all KV freed."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.build_plan import BuildPlan


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


def assert_fused_equals_layer_by_layer(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> None:
    """Every decode step as the one native call (models/fused_stack.py), then every step layer by layer on the same
    native kernels: the same tokens and log-probabilities to the last digit, all KV blocks back."""
    fused, taken = _generate_recording_path(llm, prompts, params)
    assert taken and all(taken)
    # every step layer by layer, eagerly, on the same native kernels
    runner = llm.engine.runner
    plan = runner.plan
    runner.plan = dataclasses.replace(plan, fused_decode_max_tokens=0)
    try:
        layered, taken = _generate_recording_path(llm, prompts, params)
    finally:
        runner.plan = plan
    assert taken and not any(taken)
    for a, b in zip(fused, layered, strict=True):
        # the same kernels in the same order: the same bits, so the same log-probabilities to the last digit
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def _generate_recording_path(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """Outputs, and for every decode-only step whether it ran on the fused stack."""
    taken: list[bool] = []
    decide = BuildPlan.step_route

    def recording(plan, decode_only, num_tokens, has_graph):
        route = decide(plan, decode_only, num_tokens, has_graph)
        if decode_only:
            taken.append(route == "fused")
        return route

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BuildPlan, "step_route", recording)
        return llm.generate(prompts, params, use_tqdm=False), taken
