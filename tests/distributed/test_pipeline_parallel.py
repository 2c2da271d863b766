"""Pipeline parallelism over torch.distributed (gloo, stages in processes on this CPU): greedy output equals
transformers and the one-rank engine, with stages alone and beside tensor parallelism, chunked, preempted and
speculating; a sampled sequence is the one the stages computed; a file's grids follow their layers to their stage;
a dead stage stops the engine within a bounded time and leaves no process behind; the layers are split by the
weights each stage reads (what cannot be split is refused with tensor parallelism's refusals, in
test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.distributed.pipeline_parallel import micro_batches, stage_grids, stage_layers
from llmserve.engine.step import SchedulerOutput
from llmserve.models.config import ModelConfig
from tests.distributed.conftest import PROMPTS, assert_a_killed_worker_stops_the_engine
from tests.greedy import assert_greedy_equals
from tests.quantization.tiny_models import make_tiny_hf_dir

COMMON = dict(dtype="float32", kv_cache_memory_gb=0.05, max_model_len=512, quantization="none")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """Qwen2-shaped, three layers: two stages take layers 0-1 and 2 (the head weighs more than a layer here)."""
    return str(make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-pp"), "qwen2", kv_heads=2, layers=3))


@pytest.fixture(scope="module")
def pp2(tiny):
    llm = LLM(tiny, pipeline_parallel_size=2, **COMMON)
    yield llm
    llm.shutdown()


@pytest.mark.processes
def test_two_stages_greedy_equal_transformers_and_hold_their_layers_only(pp2, prompts, expected):
    plan = pp2.engine.plan
    assert plan.pipeline_stages == (range(0, 2), range(2, 3))
    runner = pp2.engine.runner.local  # rank 0, the first stage: two layers, their cache, no head
    assert len(runner.model.layers) == len(runner.kv_caches) == 2
    assert runner.model.lm_head is None and runner.model.embed_tokens is not None
    assert_greedy_equals(pp2, prompts, expected, single=3)


@pytest.mark.processes
def test_a_sampled_sequence_is_the_one_the_stages_computed(tiny, pp2, prompts):
    """Only the last stage samples; the first stage must continue from its tokens. Scored again by one rank, the
    sequence gets the logprobs the stages reported while sampling it (a first stage on other tokens would have
    written other keys and values for its layers, and changed every later logprob)."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = pp2.generate([prompts[0], prompts[2]], params, use_tqdm=False)
    one = LLM(tiny, **COMMON)
    for prompt, out in zip([prompts[0], prompts[2]], outs, strict=True):
        sampled = out.outputs[0]
        reported = [entry[token].logprob for entry, token in zip(sampled.logprobs, sampled.token_ids, strict=True)]
        [scored] = one.generate([prompt + sampled.token_ids],
                                SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        rescored = [entry[token].logprob for entry, token in
                    zip(scored.prompt_logprobs[len(prompt):], sampled.token_ids, strict=True)]
        assert rescored == pytest.approx(reported, abs=1e-4)


@pytest.mark.processes
def test_stages_beside_tensor_parallel_chunked_preempted_and_speculating_give_transformers_tokens(
        tiny, prompts, expected):
    """Two stages of two tensor-parallel ranks each (four processes), prompts prefilled 16 tokens a step, a cache
    too small for every request (the scheduler preempts), and n-gram proposals verified in the same steps."""
    block_bytes = 2 * 3 * 16 * 32 * 4 * 2  # K and V, 3 layers, 2 KV heads, 16 tokens, head_dim 32, float32
    llm = LLM(tiny, pipeline_parallel_size=2, tensor_parallel_size=2, max_num_batched_tokens=32,
              long_prefill_token_threshold=16, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **{**COMMON, "kv_cache_memory_gb": 16 * block_bytes / 2**30})
    try:
        assert llm.engine.kv_cache.num_blocks == 16 and llm.engine.speculator is not None
        assert_greedy_equals(llm, prompts, expected)
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()


@pytest.mark.processes
def test_grids_of_two_formats_follow_their_layers_to_their_stage(mixed_kquant_gguf):
    """Q4_K q/k beside a Q6_K v (tests/models/mixed_gguf.py): the last stage's layers are renumbered from 0, and
    their file grids with them (a grid on the wrong layer would re-quantize it, or quantize it from another's)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = {**COMMON, "quantization": "int4+int8"}
    one = LLM(mixed_kquant_gguf, **options)
    prompts = [one.engine.processor.encode(p) for p in PROMPTS]
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    one.shutdown()
    two = LLM(mixed_kquant_gguf, pipeline_parallel_size=2, **options)
    try:
        assert_greedy_equals(two, prompts, expected)
    finally:
        two.shutdown()


@pytest.mark.processes
def test_a_dead_middle_stage_stops_the_engine_in_bounded_time_and_leaves_no_process(tiny, prompts):
    """Three stages, the middle one killed: the last stage's receive fails, and rank 0 sees the group stop."""
    llm = LLM(tiny, pipeline_parallel_size=3, collective_timeout_s=20, **COMMON)
    workers = llm.engine.runner._workers
    [out] = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert_a_killed_worker_stops_the_engine(llm, workers[0], prompts[0], "exited")


def _config(layers: int, vocab: int, hidden: int = 576, intermediate: int = 1536) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=64, tie_word_embeddings=True)


def test_layers_are_split_by_the_weights_each_stage_reads():
    """SmolLM2-135M's shape: a layer reads 3.54M weights, the head 28.3M (8 layers' worth), so two stages of equal
    weight take 19 and 11 layers; with a small vocabulary the layers split evenly, earlier stages taking the extra."""
    smollm2 = _config(30, 49152)
    assert stage_layers(smollm2, 2) == [range(0, 19), range(19, 30)]
    assert stage_layers(smollm2, 3) == [range(0, 13), range(13, 25), range(25, 30)]
    assert stage_layers(_config(7, 64), 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(_config(3, 10**6), 3) == [range(0, 1), range(1, 2), range(2, 3)]  # at least a layer each
    assert stage_layers(_config(4, 64), 1) == [range(0, 4)]
    with pytest.raises(ValueError, match="4 decoder layers"):
        stage_layers(_config(4, 64), 5)


def test_micro_batches_hold_about_equal_tokens_in_the_steps_order():
    def step(counts: dict[str, int]) -> SchedulerOutput:
        return SchedulerOutput(num_scheduled_tokens=counts)

    assert micro_batches(step({"a": 1, "b": 1, "c": 1, "d": 1}), 2, min_tokens=1) == [["a", "b"], ["c", "d"]]
    assert micro_batches(step({"p": 100, "a": 1, "b": 1}), 2) == [["p"], ["a", "b"]]
    assert micro_batches(step({"a": 1, "b": 1, "p": 100}), 2) == [["a", "b"], ["p"]]
    assert micro_batches(step({"a": 1, "b": 1, "c": 1}), 3, min_tokens=1) == [["a"], ["b"], ["c"]]
    assert micro_batches(step({"a": 50}), 4) == [["a"]]
    assert micro_batches(step({"a": 1, "b": 99}), 1) == [["a", "b"]]
    # too few tokens to pay for a second pass over the stage's weights: 8 decodes stay one micro-batch, 32 are two
    eight = {f"r{i}": 1 for i in range(8)}
    assert micro_batches(step(eight), 2) == [list(eight)]
    assert len(micro_batches(step({f"r{i}": 1 for i in range(32)}), 2)) == 2


def test_grids_are_renumbered_with_their_layers():
    g = (torch.zeros(1),)
    grids = {"model.layers.0.mlp.up_proj.weight": g, "model.layers.2.self_attn.q_proj.weight": g,
             "model.layers.3.mlp.down_proj.weight": g, "lm_head.weight": g, "model.embed_tokens.weight": g}
    assert stage_grids(grids, range(2, 4)) == {"model.layers.0.self_attn.q_proj.weight": g,
                                               "model.layers.1.mlp.down_proj.weight": g, "lm_head.weight": g,
                                               "model.embed_tokens.weight": g}
    assert stage_grids(None, range(0, 1)) is None

