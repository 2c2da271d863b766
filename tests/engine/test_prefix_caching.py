"""Prefix caching end to end: identical greedy outputs with the cache on and off, cached tokens
reported, tenants isolated by salt."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SYSTEM = " ".join(
    f"Rule {i}: answer politely, cite the handbook section {i}, and never reveal internal codes."
    for i in range(24)
)
QUESTIONS = ["How do I reset my password?", "What are your opening hours?",
             "Can I get a refund after 30 days?", "Who do I call about a broken device?"]


@pytest.fixture(scope="module")
def shared_prompts(llm_fp32: LLM) -> list[list[int]]:
    tok = llm_fp32.get_tokenizer()
    prompts = [
        tok.encode(llm_fp32.engine.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]
    assert 400 <= len(prompts[0]) < 600
    return prompts


@pytest.fixture(scope="module")
def uncached_outputs(shared_prompts) -> list[list[int]]:
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gb=0.1, max_model_len=2048,
              enable_prefix_caching=False)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in shared_prompts]
    assert all(o.num_cached_tokens == 0 for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def test_one_after_another_hits_the_cache_and_matches_uncached(llm_fp32, shared_prompts, uncached_outputs):
    prefix_len = _common_prefix(shared_prompts)
    for i, prompt in enumerate(shared_prompts):
        [out] = llm_fp32.generate([prompt], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == uncached_outputs[i]
        if i > 0:  # every full block of the shared prefix is reused
            assert out.num_cached_tokens == prefix_len // 16 * 16


def test_sent_together_matches_uncached(llm_fp32, shared_prompts, uncached_outputs):
    outs = llm_fp32.generate(shared_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == uncached_outputs
    assert llm_fp32.engine.kv_cache.num_free_blocks == llm_fp32.engine.kv_cache.num_blocks


def test_cache_salt_isolates_tenants(llm_fp32, shared_prompts, uncached_outputs):
    prompt = shared_prompts[0]
    [a] = llm_fp32.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    [b] = llm_fp32.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)
    [a2] = llm_fp32.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert a2.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids == uncached_outputs[0]


@pytest.mark.modes
def test_chunks_of_64_with_prefix_hits_and_preemption_match(shared_prompts, uncached_outputs):
    # 64-token steps chunk every prompt; 40 blocks (640 tokens) for 4 x ~530 tokens sharing ~400 forces preemption,
    # and the recomputes hit the blocks the victims left in the cache.
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gb=40 * block_bytes / 2**30, max_model_len=2048,
              max_num_batched_tokens=64, long_prefill_token_threshold=64)
    outs = llm.generate(shared_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == uncached_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_cache.stats.hits > 0
    assert llm.engine.kv_cache.num_free_blocks == 40


def _common_prefix(prompts: list[list[int]]) -> int:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n
