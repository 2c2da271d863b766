"""A request that makes an engine step fail fails alone: the step is re-run in halves until the failure is
pinned on one request, and the others get the tokens a clean batch gives them."""

from __future__ import annotations

from llmserve import LLM, SamplingParams


def test_a_request_that_breaks_the_step_fails_alone(llm_fp32: LLM, prompt_token_ids):
    engine = llm_fp32.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = prompt_token_ids[:5]
    expected = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, greedy, use_tqdm=False)]

    # A fault past admission's checks, in the real sampler: the step's banned-token mask (min_tokens) indexes
    # the logits with a token id past the vocabulary, which raises inside the batched sampling call.
    for i, ids in enumerate(prompts):
        engine.add_request(f"ok-{i}", ids, greedy)
    broken = engine.add_request("broken", prompt_token_ids[5], SamplingParams(min_tokens=4, max_tokens=8))
    broken.params.stop_token_ids = [engine.model_config.vocab_size + 7]
    finals, errors = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas, folded into whole outputs
            if out.request_id in finals:
                finals[out.request_id].add(out)
            else:
                finals[out.request_id] = out
            if out.error:
                errors[out.request_id] = out.error
    assert list(errors) == ["broken"] and "IndexError" in errors["broken"]
    assert finals["broken"].outputs[0].finish_reason == "abort"
    assert [finals[f"ok-{i}"].outputs[0].token_ids for i in range(5)] == expected
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.requests
