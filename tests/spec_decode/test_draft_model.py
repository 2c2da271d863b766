"""Draft-model speculation: a draft run by our own engine (SmolLM2 on its int4 path drafting for itself in
float32), exact greedy output, both caches emptied after a run, one KV budget shared; a draft with another
vocabulary is refused at start."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.build_plan import AUTO_DRAFT_BELOW
from llmserve.loader.default_models import DEFAULT_MODEL, EMBEDDED_MODELS
from tests.greedy import assert_equal_up_to_a_near_tie, assert_greedy_equals
from tests.model_files import needs_qwen

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
    assert draft.tokenizer is llm_draft.engine.tokenizer  # the same tokenizer files: read once, shared


def test_the_draft_cache_comes_out_of_the_same_budget(llm_draft: LLM, llm_fp32: LLM):
    target, draft = llm_draft.engine, llm_draft.engine.speculator.proposer.engine
    alone = llm_fp32.engine  # the same model and budget without a draft
    assert target.kv_cache.num_blocks == alone.kv_cache.num_blocks - int(alone.kv_cache.num_blocks * 0.25)
    assert draft.kv_cache_bytes <= alone.kv_cache_bytes * 0.25


def test_seeded_sampling_takes_no_drafts_and_is_the_plain_text(llm_draft: LLM, llm_fp32: LLM, prompt_token_ids):
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=24, seed=5, ignore_eos=True)
    drafts = llm_draft.engine.stats().spec_decode.num_drafts
    first = [o.outputs[0].token_ids for o in llm_draft.generate(prompt_token_ids[4:6], params, use_tqdm=False)]
    plain = [o.outputs[0].token_ids for o in llm_fp32.generate(prompt_token_ids[4:6], params, use_tqdm=False)]
    assert first == plain and all(len(t) == 24 for t in first)
    assert llm_draft.engine.stats().spec_decode.num_drafts == drafts


@needs_qwen
def test_a_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="another vocabulary"):
        LLM(**FP32, kv_cache_memory_gb=0.1, speculative_config={
            "method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 2})


def test_the_default_drafts_with_a_registered_draft(monkeypatch, prompt_token_ids):
    """`speculative_config="auto"` with a draft registered for the model and installed: a draft model at low load
    instead of n-gram lookup. The default model registered as its own draft stands in for the registered pair
    (Qwen2.5-Coder-1.5B with the 0.5B, too large for CI): greedy tokens as without speculation (up to a near tie),
    no proposals for a seeded sampled request, both caches emptied."""
    entry = EMBEDDED_MODELS[DEFAULT_MODEL]
    monkeypatch.setitem(EMBEDDED_MODELS, DEFAULT_MODEL, dataclasses.replace(entry, draft=DEFAULT_MODEL))
    auto = LLM(kv_cache_memory_gb=0.25)
    spec = auto.engine.plan.speculative
    if not auto.engine.plan.fused_decode_max_tokens:  # no one-call stack on this host: nothing to speculate with
        assert spec is None
        return
    assert (spec.method, spec.model, spec.automatic, spec.disable_by_batch_size) == (
        "draft_model", DEFAULT_MODEL, True, AUTO_DRAFT_BELOW)
    assert "a draft model" in auto.engine.plan.reasons["speculation"]
    off = LLM(kv_cache_memory_gb=0.25, speculative_config="off")
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    for prompt in prompt_token_ids[:3]:  # alone: c=1 speculates
        [fast], [plain] = (llm.generate([prompt], greedy, use_tqdm=False) for llm in (auto, off))
        assert_equal_up_to_a_near_tie(fast.outputs[0], plain.outputs[0])
    # The first proposals follow from the speculator's priors; whether more pay is timed, and a self-draft of the
    # 135M model costs what it saves, so their number (and an acceptance rate over them) is the host's noise: CI on
    # an AMD host once saw 2 of 4 kept. How well a draft agrees is the fixed-depth test's claim above.
    stats = auto.engine.stats().spec_decode
    assert stats.num_drafts > 0
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)
    [sampled] = auto.generate(prompt_token_ids[:1], seeded, use_tqdm=False)
    assert auto.engine.stats().spec_decode.num_drafts == stats.num_drafts  # none for it
    [again] = off.generate(prompt_token_ids[:1], seeded, use_tqdm=False)
    assert sampled.outputs[0].token_ids == again.outputs[0].token_ids
    draft = auto.engine.speculator.proposer.engine
    for engine in (auto.engine, draft):
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks and not engine.has_unfinished_requests()
