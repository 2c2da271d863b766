"""Deterministic: with every step on the quantized kernels (`--large-steps quantized`, the default where small steps
take Q8_0 inputs: K-quant mixes such as Qwen2.5-Coder's) a request's tokens and log-probabilities, to the last bit,
do not depend on the other requests in its batch, on prefix-cache hits, on chunked prefill, on preemption or on
speculation, in bfloat16 on the file's quantization. What makes it so: every product on the quantized kernels
whatever the step's size, and prompt tokens attending on the decode kernel, whose context split depends on the row
alone (engine/build_plan.py, "determinism"). Checked here on SmolLM2's Q4_1 and Qwen2.5-Coder-0.5B's Q8_0 file,
whose ~16-bit inputs the kernels take as well."""

from __future__ import annotations

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.loader.default_models import PARTED_MODELS, installed_path

QWEN = "qwen2.5-coder-0.5b"
MODELS = [None, pytest.param(QWEN, marks=pytest.mark.qwen)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)


def _prompts(vocab: int) -> list[list[int]]:
    """Eight prompts of 25-220 tokens, most sharing a prefix of some length (prefix-cache hits), as token ids."""
    rng = random.Random(7)
    prefix = [rng.randrange(100, vocab) for _ in range(200)]
    return [prefix[: rng.randrange(20, 200)] + [rng.randrange(100, vocab) for _ in range(rng.randrange(5, 40))]
            for _ in range(8)]


def _engine(model: str | None, **options) -> LLM:
    if model is not None and installed_path(PARTED_MODELS[model]) is None:
        pytest.skip(f"{model} is not assembled here (`llmserve download {model}`; setup does it)")
    llm = LLM(model, dtype="bfloat16", max_model_len=1024, large_steps="quantized", **{
        "kv_cache_memory_gb": 0.25, "speculative_config": "off", "enable_prefix_caching": False, **options})
    assert llm.engine.plan.batch_invariant, llm.engine.plan.describe()
    return llm


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks  # every block back
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module", params=MODELS, ids=["smollm2", "qwen0.5b"])
def reference(request):
    """Each prompt alone on a plain engine (no prefix caching, no speculation, whole prompts): the bits every other
    way of running it must give."""
    llm = _engine(request.param)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    alone = [_run(llm, [p])[0] for p in prompts]
    return request.param, llm, prompts, alone


def test_batched_equals_alone(reference):
    model, llm, prompts, alone = reference
    assert _run(llm, prompts) == alone


def test_prefix_cache_hits_equal_a_whole_prompt(reference):
    model, _, prompts, alone = reference
    llm = _engine(model, enable_prefix_caching=True)
    _run(llm, prompts[:2])  # their blocks cached: the batch below hits them
    before = llm.engine.kv_cache.stats.hits
    assert _run(llm, prompts) == alone
    assert llm.engine.kv_cache.stats.hits > before


def test_chunked_prefill_equals_a_whole_prompt(reference):
    model, _, prompts, alone = reference
    llm = _engine(model, max_num_batched_tokens=48)  # every prompt in chunks, beside other requests' decodes
    assert _run(llm, prompts) == alone


def test_preemption_equals_a_run_without(reference):
    model, llm, prompts, _ = reference
    longer = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
    alone = [_run(llm, [p], longer)[0] for p in prompts]
    block_bytes = llm.engine.plan.kv_cache.bytes_per_block
    # 20 blocks of 16 tokens for 8 requests of up to 304: running ones grow out of room and are preempted
    small = _engine(model, kv_cache_memory_gb=20 * block_bytes / 2**30)
    assert small.engine.kv_cache.num_blocks == 20
    assert _run(small, prompts, longer) == alone
    assert small.engine.scheduler.num_preemptions > 0


def test_speculation_equals_plain_decoding(reference):
    model, _, prompts, alone = reference
    llm = _engine(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [_run(llm, [p])[0] for p in prompts] == alone
    stats = llm.engine.speculator.stats  # the outputs repeat themselves: lookup proposes, and some are kept
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_seeded_sampling_is_the_same_in_a_batch_as_alone(reference):
    _, llm, prompts, _ = reference
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True, logprobs=2)
    [alone] = _run(llm, [prompts[3]], seeded)
    batch = _run(llm, [prompts[3]] * 6 + prompts[:2], seeded)
    assert batch[:6] == [alone] * 6
