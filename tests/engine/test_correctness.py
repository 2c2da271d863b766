"""Greedy output of our engine equals transformers on the same weights, in every mode."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.models.decoder import use_native_elementwise
from tests.greedy import assert_greedy_equals

GREEDY_64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.mark.slow
def test_greedy_one_at_a_time_matches_transformers(llm_fp32: LLM, prompt_token_ids, hf_reference):
    """Every prompt alone (the fast tier runs one alone beside the batch): 512 one-token float32 steps."""
    for ids, expected in zip(prompt_token_ids, hf_reference, strict=True):
        [out] = llm_fp32.generate([ids], GREEDY_64, use_tqdm=False)
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "length"
    assert llm_fp32.engine.kv_cache.num_free_blocks == llm_fp32.engine.kv_cache.num_blocks


def test_greedy_batched_matches_transformers(llm_fp32: LLM, prompt_token_ids, hf_reference):
    outs = llm_fp32.generate(prompt_token_ids, GREEDY_64, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference
    assert [o.prompt_token_ids for o in outs] == prompt_token_ids
    [alone] = llm_fp32.generate([prompt_token_ids[6]], GREEDY_64, use_tqdm=False)  # every decode step one token
    assert alone.outputs[0].token_ids == hf_reference[6]
    assert llm_fp32.engine.kv_cache.num_free_blocks == llm_fp32.engine.kv_cache.num_blocks


def test_text_is_the_decoded_tokens(llm_fp32: LLM, prompt_token_ids):
    outs = llm_fp32.generate(prompt_token_ids[:3], GREEDY_64, use_tqdm=False)
    tok = llm_fp32.get_tokenizer()
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_preemption_keeps_outputs_and_frees_every_block(prompt_token_ids, hf_reference):
    # 40 blocks of 16 tokens = 640 tokens for 8 requests needing ~1,100 tokens: preemption must happen.
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gb=40 * block_bytes / 2**30, max_model_len=2048)
    assert llm.engine.kv_cache.num_blocks == 40
    outs = llm.generate(prompt_token_ids, GREEDY_64, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_reference
    assert llm.engine.kv_cache.num_free_blocks == 40
    assert not llm.engine.requests


def test_small_token_budget_chunks_prompts_and_keeps_outputs(prompt_token_ids, hf_reference):
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gb=0.1, max_model_len=2048,
              max_num_batched_tokens=64, long_prefill_token_threshold=64)
    outs = llm.generate(prompt_token_ids, GREEDY_64, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


@pytest.mark.modes
def test_torch_attention_path_matches_transformers(prompt_token_ids, hf_reference):
    # the fallback of the native kernel (other devices, no compiler) owes the same tokens
    llm = LLM(dtype="float32", quantization="none", kernels="torch", kv_cache_memory_gb=0.25, max_model_len=2048)
    assert llm.engine.plan.attention == "torch"
    assert_greedy_equals(llm, prompt_token_ids, hf_reference, single=1)


@pytest.mark.modes
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_elementwise_kernels_match_transformers(kernels, prompt_token_ids, hf_reference):
    # the layers' norms, rotary and gate (and greedy's argmax) on the fused kernels or on PyTorch's ops
    llm = LLM(dtype="float32", quantization="none", kernels=kernels, kv_cache_memory_gb=0.25, max_model_len=2048)
    assert llm.engine.plan.elementwise == llm.engine.plan.argmax == kernels
    assert all(layer.input_layernorm.native == (kernels == "native") for layer in llm.engine.runner.model.layers)
    assert_greedy_equals(llm, prompt_token_ids, hf_reference, single=1)


def test_elementwise_kernels_in_bfloat16_are_as_accurate_as_pytorch(llm_fp32: LLM, prompt_token_ids):
    # bfloat16, where "auto" takes them: the same engine with its layers on the fused kernels and switched
    # back to PyTorch's ops, each against float32. Both round differently from float32 (and from each
    # other: the kernels once per op, PyTorch after every step of it), so neither matches it exactly; the
    # kernels must pick float32's next tokens and stay as close to its log-probabilities as PyTorch does
    # (measured: mean error 0.054 vs 0.046 nats over the top 5, worst 0.17 vs 0.27).
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    exact = llm_fp32.generate(prompt_token_ids, params, use_tqdm=False)
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory_gb=0.25, max_model_len=2048,
              enable_prefix_caching=False)
    assert llm.engine.plan.elementwise == llm.engine.plan.argmax == "native"

    def errors() -> list[float]:
        outs = llm.generate(prompt_token_ids, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in exact]
        return [abs(o.outputs[0].logprobs[0][token].logprob - lp.logprob)
                for o, e in zip(outs, exact, strict=True) for token, lp in e.outputs[0].logprobs[0].items()
                if token in o.outputs[0].logprobs[0]]

    native = errors()
    use_native_elementwise(llm.engine.runner.model, False)
    pytorch = errors()
    assert sum(native) / len(native) <= 2 * sum(pytorch) / len(pytorch) + 0.02
    assert max(native) <= 0.5


def test_bad_kernel_choice_and_unknown_options_are_refused():
    with pytest.raises(ValueError, match="kernels"):
        LLM(kernels="flash")
    with pytest.raises(TypeError, match="attention_backend"):
        LLM(attention_backend="native")
