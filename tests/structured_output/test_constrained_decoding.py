"""Constrained decoding in the engine: greedy output equals transformers decoding under the same token masks,
token for token, batched beside free requests and in every mode (speculative, preempted, chunked); sampled
outputs follow their constraints; a complete grammar stops its request; bad constraints are refused, and one that
fails while decoding ends its request with the error, never as a stop."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output import GrammarError, StructuredOutputManager
from llmserve.structured_output.manager import MAX_CONSTRAINT_BYTES

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
CONSTRAINTS = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(grammar='start: "The answer is " ("yes" | "no") "."'),
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
FP32 = {"dtype": "float32", "quantization": "none", "max_model_len": 2048}
MAX_TOKENS = 40


def reference_constrained_greedy(hf_model, manager: StructuredOutputManager, prompt_ids: list[int],
                                 spec: StructuredOutputsParams | None, max_new_tokens: int) -> list[int]:
    """transformers' greedy decoding with each step's logits masked by a fresh matcher of `spec`, ending where
    the grammar is complete (or refuses more): what the engine must reproduce."""
    matcher = manager.new_matcher(spec) if spec is not None else None
    out_ids: list[int] = []
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1].float().clone()
            if matcher is not None:  # bit t of the little-endian bitmask is token t
                bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
                logits[~torch.from_numpy(bits[: logits.shape[0]].astype(bool))] = float("-inf")
            token = int(logits.argmax())
            out_ids.append(token)
            if matcher is not None and (not matcher.consume_token(token) or matcher.is_stopped()):
                break
            out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


@pytest.fixture(scope="module")
def prompts(llm_fp32: LLM) -> list[list[int]]:
    texts = ["Describe a person as JSON.", "Review: I loved this film. Sentiment:", "Call me at",
             "Give me a JSON object describing a cat.", "Is the sky blue?", "Hello, my name is"]
    return [llm_fp32.get_tokenizer().encode(t) for t in texts]


@pytest.fixture(scope="module")
def expected(llm_fp32: LLM, hf_model, prompts) -> list[list[int]]:
    specs = [*CONSTRAINTS, None]
    return [reference_constrained_greedy(hf_model, llm_fp32.engine.structured, ids, spec, MAX_TOKENS)
            for ids, spec in zip(prompts, specs, strict=True)]


def _params(spec: StructuredOutputsParams | None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=spec is None, structured_outputs=spec,
                          **extra)


def _run(llm: LLM, prompts: list[list[int]], copies: int = 1) -> list[list[int]]:
    outs = llm.generate(prompts * copies, [_params(spec) for spec in [*CONSTRAINTS, None]] * copies, use_tqdm=False)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks and not llm.engine.requests
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_masked_transformers_batched_beside_a_free_request(llm_fp32: LLM, prompts, expected):
    assert _run(llm_fp32, prompts) == expected
    for spec, ids in zip(CONSTRAINTS, prompts, strict=False):  # and each alone
        [alone] = llm_fp32.generate([ids], _params(spec), use_tqdm=False)
        assert alone.outputs[0].token_ids == expected[prompts.index(ids)]


def test_the_outputs_match_their_constraints(llm_fp32: LLM, prompts, expected):
    tok = llm_fp32.get_tokenizer()
    texts = [tok.decode(ids) for ids in expected]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert texts[1] in ("positive", "negative", "neutral")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[2])
    assert isinstance(json.loads(texts[3]), dict)
    assert texts[4] in ("The answer is yes.", "The answer is no.")


@pytest.mark.modes
def test_speculative_preempted_and_chunked_runs_keep_the_constrained_tokens(prompts, expected):
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4
    spec_tight = LLM(**FP32, kv_cache_memory_gb=4 * block_bytes / 2**30, max_num_batched_tokens=16,
                     long_prefill_token_threshold=16, speculative_config=NGRAM)
    assert _run(spec_tight, prompts, copies=2) == expected * 2
    stats = spec_tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_drafts > 0


def test_a_complete_grammar_stops_its_request_at_once(llm_fp32: LLM, prompts):
    [out] = llm_fp32.generate([prompts[1]], _params(StructuredOutputsParams(choice=["definitely"])), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text == "definitely" and completion.finish_reason == "stop"
    assert completion.token_ids == llm_fp32.get_tokenizer().encode("definitely", add_special_tokens=False)


def test_sampled_outputs_follow_their_constraints(llm_fp32: LLM, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=7, n=1, max_tokens=80, structured_outputs=spec)
              for spec in CONSTRAINTS[:3]]
    outs = llm_fp32.generate(prompts[:3] * 3, params * 3, use_tqdm=False)
    for i, out in enumerate(outs):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason == "stop", (text, reason)
        if i % 3 == 0:
            jsonschema.validate(json.loads(text), PERSON)
        elif i % 3 == 1:
            assert text in ("positive", "negative", "neutral")
        else:
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)


def test_proposals_are_cut_at_the_first_refused_token(llm_fp32: LLM):
    manager = llm_fp32.engine.structured
    tok = llm_fp32.get_tokenizer()
    matcher = manager.new_matcher(StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    good = tok.encode("555-12", add_special_tokens=False)
    draft = good + tok.encode("abc", add_special_tokens=False)
    assert manager.filter_proposals({"a": draft, "b": [1, 2]}, {"a": matcher}) == {"a": good, "b": [1, 2]}
    masks = manager.bitmasks([("a", matcher, good)])["a"]
    assert masks.shape == (1 + len(good), manager.mask_words)
    digit = tok.encode("7", add_special_tokens=False)[0]
    assert (masks[0, digit // 32] >> (digit % 32)) & 1  # a digit may come first
    assert matcher.validate_tokens(good) == len(good)  # the masks left the matcher where it was


# A schema of flat string fields over the size budget: the grammar library took seconds on one like it, then
# panicked with a backtrace.
HUGE_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 30,
                                                                "description": "x" * 20} for i in range(3000)}}
# Passes its first token, then the regex's automaton outgrows the library's limit: fails while decoding.
FAILS_LATER = r"[a-z]{5}b{100000}"


@pytest.mark.parametrize(("spec", "message"), [
    (dict(regex="(?<=a)b"), "look-around"),
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
    (dict(grammar="start: start"), "no text satisfies it"),
    (dict(json={"$ref": "#"}), "no text satisfies it"),
    (dict(json={"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
     "no text satisfies it"),
    (dict(regex="a{1000000}"), "too many expressions"),  # at its first token
    (dict(json=HUGE_SCHEMA), f"over the {MAX_CONSTRAINT_BYTES // 1024} KiB"),
    (dict(choice=[f"c{i}" for i in range(50_000)]), "KiB"),
])
def test_bad_constraints_are_refused_with_the_reason(llm_fp32: LLM, spec, message):
    with pytest.raises(GrammarError, match=message) as refused:
        llm_fp32.engine.structured.compile(StructuredOutputsParams(**spec))
    assert "\n" not in str(refused.value) and "backtrace" not in str(refused.value)
    with pytest.raises(GrammarError, match=message):  # asked again: the remembered refusal
        llm_fp32.engine.structured.compile(StructuredOutputsParams(**spec))


def test_a_constraint_that_fails_while_decoding_ends_with_the_error_not_a_stop(llm_fp32: LLM, prompt_token_ids):
    failing = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(
        regex=FAILS_LATER))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [broken, beside] = llm_fp32.generate(prompt_token_ids[1:3], [failing, free], use_tqdm=False)
    assert broken.outputs[0].finish_reason == "error" and broken.finished
    assert "failed while decoding" in broken.error and "too many expressions" in broken.error
    assert re.fullmatch("[a-z]{1,5}", broken.outputs[0].text), broken.outputs[0].text  # what it kept to before
    [alone] = llm_fp32.generate([prompt_token_ids[2]], free, use_tqdm=False)
    assert beside.outputs[0].token_ids == alone.outputs[0].token_ids and beside.error is None
    assert llm_fp32.engine.kv_cache.num_free_blocks == llm_fp32.engine.kv_cache.num_blocks


def test_thousands_of_choices_are_one_of_them(llm_fp32: LLM, prompt_token_ids):
    """A choice list is one alternative of the lexer, not a rule with a row per choice (rules are limited to
    2,000 items a row by the library)."""
    choices = [f"option {i}" for i in range(5000)]
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices))
    [out] = llm_fp32.generate([prompt_token_ids[1]], params, use_tqdm=False)
    assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"


def test_one_constraint_per_request():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
