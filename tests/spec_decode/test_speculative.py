"""Speculative decoding in the engine: greedy output equal to decoding without it, token for token, in
every mode (batched, alone, prefix-cached, chunked, preempted), stops inside an accepted run, and every
KV block back after a run. Proposals are forced (adaptive off): the cost model would rightly skip many
on this float32 model, and these tests are about correctness wherever proposals do run."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from tests.greedy import assert_equal_up_to_a_near_tie, assert_greedy_equals

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
FP32 = {"dtype": "float32", "quantization": "none", "max_model_len": 2048}


@pytest.fixture(scope="module")
def llm_spec() -> LLM:
    return LLM(**FP32, kv_cache_memory_gb=0.25, speculative_config=NGRAM)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_transformers_batched_and_alone(llm_spec: LLM, prompt_token_ids, hf_reference):
    before = llm_spec.engine.stats().spec_decode.num_drafts
    assert_greedy_equals(llm_spec, prompt_token_ids, hf_reference, single=6)
    stats = llm_spec.engine.stats().spec_decode
    assert stats.num_drafts - before > 20 and stats.num_accepted_tokens > 0  # it did speculate, and keep some
    assert 0 < stats.acceptance_rate <= 1 and 1 < stats.mean_acceptance_length <= 5


def test_a_prefix_built_by_verified_tokens_serves_later_requests(llm_spec: LLM, prompt_token_ids, llm_fp32):
    """Blocks filled during speculation are registered only with verified tokens: a prompt that extends an
    earlier request's output hits them and still decodes exactly as a cold engine does."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    [first] = llm_spec.generate([prompt_token_ids[6]], params, use_tqdm=False)
    follow_up = prompt_token_ids[6] + first.outputs[0].token_ids
    [hit] = llm_spec.generate([follow_up], params, use_tqdm=False)
    assert hit.num_cached_tokens >= len(follow_up) - 16 - llm_spec.engine.kv_cache.block_size
    [cold] = llm_fp32.generate([follow_up], params, use_tqdm=False)
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.modes
def test_preempted_and_chunked_runs_keep_their_tokens(prompt_token_ids, hf_reference):
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4
    tight = LLM(**FP32, kv_cache_memory_gb=40 * block_bytes / 2**30, speculative_config=NGRAM)
    outs = tight.generate(prompt_token_ids, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                          use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.stats().spec_decode.num_drafts > 0
    assert _tokens(outs) == hf_reference
    assert tight.engine.kv_cache.num_free_blocks == tight.engine.kv_cache.num_blocks and not tight.engine.requests
    chunked = LLM(**FP32, kv_cache_memory_gb=0.1, max_num_batched_tokens=64, long_prefill_token_threshold=64,
                  speculative_config=NGRAM)
    assert_greedy_equals(chunked, prompt_token_ids, hf_reference)


@pytest.mark.parametrize("limits", [
    {"max_tokens": 23},  # reached inside an accepted run
    pytest.param({"max_tokens": 64, "stop": "STOP"}, marks=pytest.mark.modes),  # replaced below by expected text
    pytest.param({"max_tokens": 64, "stop_token_ids": "TOKEN"}, marks=pytest.mark.modes),  # and an expected token
])
def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(llm_spec: LLM, llm_fp32: LLM, prompt_token_ids,
                                                                    hf_reference, limits):
    prompts = prompt_token_ids[5:]
    tokenizer = llm_fp32.get_tokenizer()
    for ids, expected in zip(prompts, hf_reference[5:], strict=True):
        params = dict(limits, temperature=0, ignore_eos=True)
        if params.get("stop") == "STOP":
            text = tokenizer.decode(expected[:40])
            params["stop"] = [text[len(text) // 2 : len(text) // 2 + 6]]
        if params.get("stop_token_ids") == "TOKEN":
            params["stop_token_ids"] = [expected[30]]
        plain, spec = (llm.generate([ids], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
                       for llm in (llm_fp32, llm_spec))
        assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == \
            (plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason)
    assert llm_spec.engine.kv_cache.num_free_blocks == llm_spec.engine.kv_cache.num_blocks


@pytest.mark.slow
def test_eos_inside_an_accepted_run_ends_the_request(llm_spec: LLM, llm_fp32: LLM):
    """Up to 100 float32 tokens a chat, with and without speculation, until EOS."""
    chat = [[{"role": "user", "content": "Say 'yes yes yes yes' and nothing else."}],
            [{"role": "user", "content": "Count: one two three one two three one two three"}]]
    params = SamplingParams(temperature=0, max_tokens=100)
    plain, spec = (llm.chat(chat, params, use_tqdm=False) for llm in (llm_fp32, llm_spec))
    assert [o.outputs[0].finish_reason for o in spec] == [o.outputs[0].finish_reason for o in plain]
    assert spec[0].outputs[0].finish_reason == "stop"
    assert _tokens(spec) == _tokens(plain)


@pytest.mark.modes
def test_penalties_logprobs_and_min_tokens_see_the_proposals_before_them(llm_spec: LLM, llm_fp32: LLM,
                                                                         prompt_token_ids):
    params = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.2,
                            min_tokens=30, logprobs=3)
    plain, spec = (llm.generate(prompt_token_ids[4:7], params, use_tqdm=False) for llm in (llm_fp32, llm_spec))
    assert _tokens(spec) == _tokens(plain)
    for p, s in zip(plain, spec, strict=True):
        for p_entry, s_entry in zip(p.outputs[0].logprobs, s.outputs[0].logprobs, strict=True):
            assert list(p_entry) == list(s_entry)
            assert all(abs(p_entry[t].logprob - s_entry[t].logprob) < 1e-3 for t in p_entry)


@pytest.mark.modes
def test_logit_bias_applies_to_every_verified_position(llm_spec: LLM, llm_fp32: LLM, prompt_token_ids):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    unbiased = _tokens(llm_fp32.generate(prompt_token_ids[4:7], base, use_tqdm=False))
    bias = {unbiased[0][0]: -100.0, unbiased[0][3]: 3.0, unbiased[1][10]: -5.0}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias=bias)
    before = llm_spec.engine.stats().spec_decode.num_accepted_tokens
    plain, spec = (_tokens(llm.generate(prompt_token_ids[4:7], params, use_tqdm=False)) for llm in (llm_fp32, llm_spec))
    assert llm_spec.engine.stats().spec_decode.num_accepted_tokens > before  # proposals were verified under the bias
    assert spec == plain and plain != unbiased


@pytest.mark.modes
def test_seeded_sampling_is_the_same_with_or_without_speculation(llm_spec: LLM, llm_fp32: LLM, prompt_token_ids):
    """An explicit configuration too: a seeded request that samples gets no proposals, so its text is what it is
    without speculation, at any load."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=11, ignore_eos=True)
    drafts = llm_spec.engine.stats().spec_decode.num_drafts
    first = _tokens(llm_spec.generate(prompt_token_ids[5:8], params, use_tqdm=False))
    again = _tokens(llm_spec.generate(prompt_token_ids[5:8], params, use_tqdm=False))
    assert first == again and all(len(t) == 40 for t in first)
    assert first == _tokens(llm_fp32.generate(prompt_token_ids[5:8], params, use_tqdm=False))
    assert llm_spec.engine.stats().spec_decode.num_drafts == drafts
    assert llm_spec.engine.kv_cache.num_free_blocks == llm_spec.engine.kv_cache.num_blocks


def test_on_by_default_where_one_call_runs_the_decoder(prompt_token_ids):
    """`speculative_config="auto"`, the default: where the one native call runs the decoder, greedy requests get
    n-gram proposals (kept ones included) and decode as the same engine without speculation does; a seeded request
    that samples gets none, so its text is the same either way; every KV block comes back."""
    auto = LLM(kv_cache_memory_gb=0.25)
    if not auto.engine.plan.fused_decode_max_tokens:  # no one-call stack on this host: nothing to speculate with
        assert auto.engine.plan.speculative is None and auto.engine.speculator is None
        return
    off = LLM(kv_cache_memory_gb=0.25, speculative_config="off")
    assert off.engine.speculator is None and auto.engine.speculator.config.automatic
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
    prompts = prompt_token_ids[:4]
    fast = [auto.generate([p], greedy, use_tqdm=False)[0].outputs[0] for p in prompts]  # alone: c=1 speculates
    stats = auto.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    for out, ref in zip(fast, (off.generate([p], greedy, use_tqdm=False)[0].outputs[0] for p in prompts), strict=True):
        assert_equal_up_to_a_near_tie(out, ref)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=48, ignore_eos=True)
    [sampled] = auto.generate(prompts[:1], seeded, use_tqdm=False)
    assert auto.engine.stats().spec_decode.num_drafts == stats.num_drafts  # none for it
    assert _tokens([sampled]) == _tokens(off.generate(prompts[:1], seeded, use_tqdm=False))
    assert auto.engine.kv_cache.num_free_blocks == auto.engine.kv_cache.num_blocks and not auto.engine.requests
    # what the engine does after its own requests (calibration, the compile warm-up): their step times and counts
    # are nobody's traffic, and the speculator starts over
    auto.engine._forget_own_requests()
    assert auto.engine.speculator.cost.line() is None and auto.engine.stats().spec_decode.num_drafts == 0
