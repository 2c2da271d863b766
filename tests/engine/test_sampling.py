"""Sampling parameters: seeds, stop conditions, penalties, logprobs and argument validation."""

from __future__ import annotations

import math

import pytest

from llmserve import LLM, SamplingParams
from llmserve.evaluate.reference import reference_greedy


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm_fp32: LLM, prompt_token_ids):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    [alone] = llm_fp32.generate([prompt_token_ids[2]], seeded, use_tqdm=False)
    noise = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = llm_fp32.generate(
        [prompt_token_ids[0], prompt_token_ids[2], prompt_token_ids[5]], [noise, seeded, noise], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert batch[1].outputs[0].text == alone.outputs[0].text


def test_different_seeds_differ_and_temperature_sampling_varies(llm_fp32: LLM, prompt_token_ids):
    outs = llm_fp32.generate(
        [prompt_token_ids[2]] * 2,
        [SamplingParams(temperature=1.5, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_stop_string_cuts_the_text(llm_fp32: LLM, prompt_token_ids):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [full] = llm_fp32.generate([prompt_token_ids[5]], greedy, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[10:14]
    assert len(stop.strip()) > 1 and text.find(stop) == 10
    [cut] = llm_fp32.generate(
        [prompt_token_ids[5]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )
    assert cut.outputs[0].text == text[:10]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    [kept] = llm_fp32.generate(
        [prompt_token_ids[5]],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[:14]


def test_stop_token_ids_and_eos(llm_fp32: LLM, prompt_token_ids):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [full] = llm_fp32.generate([prompt_token_ids[1]], greedy, use_tqdm=False)
    stop_id = full.outputs[0].token_ids[5]
    [out] = llm_fp32.generate(
        [prompt_token_ids[1]],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    first = full.outputs[0].token_ids.index(stop_id)
    assert out.outputs[0].token_ids == full.outputs[0].token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id

    chat = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert chat.outputs[0].finish_reason == "stop"
    assert chat.outputs[0].token_ids[-1] in llm_fp32.engine.eos_token_ids
    assert "Paris" in chat.outputs[0].text and "<|im_end|>" not in chat.outputs[0].text


def test_max_tokens_and_n(llm_fp32: LLM, prompt_token_ids):
    [out] = llm_fp32.generate(
        [prompt_token_ids[3]], SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_logprobs_are_the_model_distribution(llm_fp32: LLM, prompt_token_ids):
    [out] = llm_fp32.generate(
        [prompt_token_ids[1]], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry[token].rank == 1  # greedy picks the most likely token
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:], strict=False))
        assert sum(math.exp(lp.logprob) for lp in ranked) <= 1.0 + 1e-5
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total)


def test_penalties_change_greedy_output_and_stop_repetition(llm_fp32: LLM):
    prompt = "Repeat after me: apple apple apple apple apple apple apple apple"
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [plain] = llm_fp32.generate([prompt], base, use_tqdm=False)
    [penal] = llm_fp32.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                                 repetition_penalty=1.3), use_tqdm=False,
    )
    ids = penal.outputs[0].token_ids
    assert ids != plain.outputs[0].token_ids
    assert max(ids.count(t) for t in set(ids)) < max(
        plain.outputs[0].token_ids.count(t) for t in set(plain.outputs[0].token_ids)
    )


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_bad_sampling_params_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_prompt_too_long_is_refused_and_changes_nothing(llm_fp32: LLM):
    engine = llm_fp32.engine
    free = engine.kv_cache.num_free_blocks
    with pytest.raises(ValueError, match="max_model_len"):
        llm_fp32.generate([[1] * 2048], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm_fp32.generate(["ok", [1] * 2000], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm_fp32.generate([[]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert engine.kv_cache.num_free_blocks == free and not engine.requests
    assert not engine.has_unfinished_requests()


def test_request_larger_than_the_whole_cache_is_refused():
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory_gb=4 * block_bytes / 2**30,
              max_model_len=1024)
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        llm.generate(["hello"], SamplingParams(max_tokens=100), use_tqdm=False)
    [ok] = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 8


def test_seeds_at_the_ends_of_their_range_work_and_choices_wrap(llm_fp32: LLM, prompt_token_ids):
    params = SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=4, ignore_eos=True)
    assert params.for_choice(1).seed == 0 and params.for_choice(0).seed == 2**64 - 1
    [out] = llm_fp32.generate([prompt_token_ids[1]], params, use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
    [low] = llm_fp32.generate([prompt_token_ids[1]], SamplingParams(temperature=1.0, seed=-(2**63), max_tokens=4),
                              use_tqdm=False)
    assert len(low.outputs[0].token_ids) == 4


def test_a_tiny_temperature_is_greedy(llm_fp32: LLM, prompt_token_ids):
    """Dividing logits by 1e-30 overflows to inf and NaN probabilities; below 1e-5 sampling is greedy."""
    greedy, tiny = (SamplingParams(temperature=t, max_tokens=12, ignore_eos=True) for t in (0, 1e-30))
    outs = llm_fp32.generate([prompt_token_ids[2]] * 2, [greedy, tiny], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_top_k_past_the_vocabulary_keeps_every_token(llm_fp32: LLM, prompt_token_ids):
    vocab = llm_fp32.engine.model_config.vocab_size
    outs = llm_fp32.generate(
        [prompt_token_ids[3]] * 3,
        [SamplingParams(temperature=1.0, seed=5, top_k=k, max_tokens=16, ignore_eos=True)
         for k in (-1, vocab + 1, 10**9)],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm_fp32: LLM, prompt_token_ids):
    vocab = llm_fp32.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm_fp32.generate([prompt_token_ids[0]], SamplingParams(stop_token_ids=[vocab]), use_tqdm=False)
    assert not llm_fp32.engine.has_unfinished_requests()


def test_logit_bias_greedy_equals_transformers_with_the_same_bias_batched(llm_fp32: LLM, hf_model, hf_reference,
                                                                          prompt_token_ids):
    """Each request its own biases, all in one batch beside an unbiased one: the first token the model would pick
    banned (-100), a later one of its tokens raised (+4)."""
    picks = [1, 4, 6]
    biases = [{hf_reference[i][0]: -100.0, hf_reference[i][5]: 4.0} for i in picks]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=b) for b in biases]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm_fp32.generate([prompt_token_ids[i] for i in picks] + [prompt_token_ids[2]], [*params, plain],
                             use_tqdm=False)
    for out, i, bias in zip(outs[:-1], picks, biases, strict=True):
        expected = reference_greedy(hf_model, prompt_token_ids[i], 16, logit_bias=bias)
        assert out.outputs[0].token_ids == expected
        assert expected[0] != hf_reference[i][0]
    assert outs[-1].outputs[0].token_ids == hf_reference[2][:16]  # its neighbour's biases are not its own


def test_logit_bias_outside_the_vocabulary_or_range_is_refused(llm_fp32: LLM, prompt_token_ids):
    vocab = llm_fp32.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm_fp32.generate([prompt_token_ids[0]], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert not llm_fp32.engine.has_unfinished_requests()
    for bad in ({5: 101.0}, {5: float("nan")}, {-1: 1.0}, {True: 1.0}, {"5": 1.0}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={}).logit_bias is None
