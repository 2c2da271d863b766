"""Draft-model speculation: a draft run by our own engine (SmolLM2 on its int4 path drafting for itself in
float32), exact greedy output, both caches emptied after a run, one KV budget shared; a draft with another
vocabulary is refused at start."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.loader.default_models import PARTED_MODELS, installed_path
from tests.greedy import assert_greedy_equals

DRAFT = {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3, "adaptive": False}
FP32 = {"dtype": "float32", "quantization": "none", "max_model_len": 2048}


@pytest.fixture(scope="module")
def llm_draft() -> LLM:
    return LLM(**FP32, kv_cache_memory_gb=0.25, speculative_config=DRAFT)


def test_greedy_equals_transformers_and_both_caches_empty(llm_draft: LLM, prompt_token_ids, hf_reference):
    assert_greedy_equals(llm_draft, prompt_token_ids, hf_reference, single=2)
    stats = llm_draft.engine.stats().spec_decode
    assert stats.num_drafts > 50 and stats.acceptance_rate > 0.5  # the int4 draft mostly agrees with float32
    draft = llm_draft.engine.speculator.proposer.engine
    assert not draft.has_unfinished_requests()
    assert draft.kv_cache.num_free_blocks == draft.kv_cache.num_blocks
    assert draft.plan.weights == "int4" and draft.plan.head == "int4"  # its own fastest weights, head included
    assert draft.kv_cache.block_size == 4  # a catch-up from its prefix cache stays a small step


def test_the_draft_cache_comes_out_of_the_same_budget(llm_draft: LLM, llm_fp32: LLM):
    target, draft = llm_draft.engine, llm_draft.engine.speculator.proposer.engine
    alone = llm_fp32.engine  # the same model and budget without a draft
    assert target.kv_cache.num_blocks == alone.kv_cache.num_blocks - int(alone.kv_cache.num_blocks * 0.25)
    assert draft.kv_cache_bytes <= alone.kv_cache_bytes * 0.25


def test_sampling_with_a_draft_repeats_with_its_seed(llm_draft: LLM, prompt_token_ids):
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=24, seed=5, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm_draft.generate(prompt_token_ids[4:6], params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm_draft.generate(prompt_token_ids[4:6], params, use_tqdm=False)]
    assert first == again and all(len(t) == 24 for t in first)


@pytest.mark.skipif(installed_path(PARTED_MODELS["qwen2.5-coder-0.5b"]) is None,
                    reason="qwen2.5-coder-0.5b is not assembled here (setup does it)")
def test_a_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="another vocabulary"):
        LLM(**FP32, kv_cache_memory_gb=0.1, speculative_config={
            "method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 2})
