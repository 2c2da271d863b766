"""Tensor parallelism over torch.distributed (gloo, two ranks on this CPU): greedy output equals
transformers and the one-rank engine, with and without int4; a sampled sequence is the one every rank
computed; a dead rank stops the engine within a bounded time and leaves no process behind; what cannot
be split (over ranks or pipeline stages) is refused before anything starts."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import engine_config
from llmserve.engine.build_plan import resolve_plan
from llmserve.loader import load_checkpoint
from tests.distributed.conftest import PROMPTS, assert_a_killed_worker_stops_the_engine
from tests.greedy import assert_greedy_equals
from tests.quantization.tiny_models import make_tiny_hf_dir

pytestmark = pytest.mark.processes  # tensor-parallel worker processes

COMMON = dict(dtype="float32", kv_cache_memory_gb=0.05, max_model_len=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """Qwen2-shaped (q/k/v biases, an untied head), 4 heads and 2 KV heads: two ranks take 2 and 1."""
    return str(make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-tp"), "qwen2", kv_heads=2))


@pytest.fixture(scope="module")
def tp2(tiny):
    llm = LLM(tiny, tensor_parallel_size=2, quantization="none", **COMMON)
    yield llm
    llm.shutdown()


def test_two_ranks_greedy_equals_transformers(tp2, prompts, expected):
    assert tp2.engine.plan.tensor_parallel_size == 2
    assert_greedy_equals(tp2, prompts, expected, single=3)


def test_two_ranks_chunked_and_preempted_still_give_transformers_tokens(tiny, prompts, expected):
    """Prompts prefilled 16 tokens a step, and a cache of 16 blocks that cannot hold every request: the
    scheduler preempts, and each rank recomputes its heads' blocks the same way."""
    block_bytes = 2 * 2 * 16 * 32 * 4 * 2  # K and V, 2 layers, 2 KV heads, 16 tokens, head_dim 32, float32
    llm = LLM(tiny, tensor_parallel_size=2, quantization="none", max_num_batched_tokens=32,
              long_prefill_token_threshold=16, **{**COMMON, "kv_cache_memory_gb": 16 * block_bytes / 2**30})
    try:
        assert llm.engine.kv_cache.num_blocks == 16
        assert_greedy_equals(llm, prompts, expected)
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()


def test_a_sampled_sequence_is_the_one_every_rank_computed(tiny, tp2, prompts):
    """Unseeded draws come from each process's own random stream, so a worker draws other tokens than
    rank 0 does; it must continue from rank 0's. Scored again by one rank, the sequence gets the logprobs
    the two ranks reported while sampling it (a worker on other tokens would have changed its heads'
    keys and values, and with them every later logprob)."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0)
    [out] = tp2.generate([prompts[0]], params, use_tqdm=False)
    sampled = out.outputs[0]
    reported = [entry[token].logprob for entry, token in zip(sampled.logprobs, sampled.token_ids, strict=True)]
    one = LLM(tiny, quantization="none", **COMMON)
    [scored] = one.generate([prompts[0] + sampled.token_ids],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    rescored = [entry[token].logprob for entry, token in
                zip(scored.prompt_logprobs[len(prompts[0]):], sampled.token_ids, strict=True)]
    assert rescored == pytest.approx(reported, abs=1e-4)


def test_int4_weights_shard_and_give_the_one_rank_tokens(tiny, prompts):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(tiny, quantization="int4", **COMMON)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    two = LLM(tiny, tensor_parallel_size=2, quantization="int4", **COMMON)
    try:
        assert two.engine.plan.weights == "int4"
        assert_greedy_equals(two, prompts, expected)
    finally:
        two.shutdown()


def test_rows_of_two_formats_shard_and_give_the_one_rank_tokens(mixed_kquant_gguf):
    """Q4_K q/k beside a Q6_K v (tests/models/mixed_gguf.py): two ranks, each with its share of both parts' rows
    and grids, give the one-rank tokens."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(mixed_kquant_gguf, quantization="int4+int8", **COMMON)
    assert [p.out_features for p in one.engine.runner.model.layers[0].self_attn.qkv_proj.parts] == [384, 128]
    prompts = [one.engine.processor.encode(p) for p in PROMPTS]
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    one.shutdown()
    two = LLM(mixed_kquant_gguf, tensor_parallel_size=2, quantization="int4+int8", **COMMON)
    try:  # (the ranks' layers live in their processes: their tokens are what is checked)
        assert_greedy_equals(two, prompts, expected)
    finally:
        two.shutdown()


def test_a_dead_rank_stops_the_engine_in_bounded_time_and_leaves_no_process(tiny, prompts):
    llm = LLM(tiny, tensor_parallel_size=2, quantization="none", collective_timeout_s=20, **COMMON)
    workers = llm.engine.runner._workers
    assert [w.is_alive() for w in workers] == [True]
    assert_a_killed_worker_stops_the_engine(llm, workers[0], prompts[0], "exited with code -9")
    # the group was left: a new one can form in this process
    again = LLM(tiny, tensor_parallel_size=2, quantization="none", **COMMON)
    try:
        [out] = again.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
    finally:
        again.shutdown()
    assert not any(w.is_alive() for w in again.engine.runner._workers)


@pytest.mark.parametrize(("options", "needle"), [
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=2, quantization="awq"), "llmserve quantize"),
    (dict(tensor_parallel_size=2, quantization="int4", large_steps="int8"), "calibrated in one process"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (dict(pipeline_parallel_size=3), "has 2 decoder layers"),
    (dict(pipeline_parallel_size=2, quantization="awq"), "pipeline_parallel_size=2 with quantization='awq'"),
    (dict(pipeline_parallel_size=2, large_steps="int8", quantization="int4"), "not with pipeline_parallel_size=2"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
])
def test_what_cannot_be_split_is_refused_before_anything_starts(tiny, options, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_plan(engine_config(model=tiny, **options), load_checkpoint(tiny).config)


def test_grids_are_cut_as_their_weights_whatever_their_groups():
    """int4 grids (per 32 inputs) and Q6_K grids (d per 256, sc per 16) follow their weights' rows and columns; a
    grid whose groups a rank's columns would split is left out (that layer re-quantizes its slice)."""
    from llmserve.distributed.tensor_parallel import TensorParallel, shard_grids
    from llmserve.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=512, intermediate_size=1536, num_layers=1, num_heads=8,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                      tie_word_embeddings=False)
    tp = TensorParallel(rank=1, size=2, group=None)

    def grid(out_features, in_features, units):
        return tuple(torch.arange(out_features * (in_features // u), dtype=torch.float32).view(out_features, -1)
                     for u in units)

    grids = {"model.layers.0.mlp.down_proj.weight": grid(512, 1536, (256, 16)),  # 768 columns a rank: 3 blocks
             "model.layers.0.self_attn.o_proj.weight": grid(512, 512, (256, 16)),  # 256 columns a rank
             "model.layers.0.mlp.up_proj.weight": grid(1536, 512, (32, 32)),
             "model.layers.0.self_attn.k_proj.weight": grid(128, 512, (256, 16))}
    sharded = shard_grids(grids, cfg, tp)
    d, sc = sharded["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(d, grids["model.layers.0.mlp.down_proj.weight"][0][:, 3:6])
    assert torch.equal(sc, grids["model.layers.0.mlp.down_proj.weight"][1][:, 48:96])
    assert torch.equal(sharded["model.layers.0.self_attn.o_proj.weight"][0],
                       grids["model.layers.0.self_attn.o_proj.weight"][0][:, 1:2])
    assert torch.equal(sharded["model.layers.0.mlp.up_proj.weight"][1],
                       grids["model.layers.0.mlp.up_proj.weight"][1][768:])
    assert torch.equal(sharded["model.layers.0.self_attn.k_proj.weight"][0],
                       grids["model.layers.0.self_attn.k_proj.weight"][0][64:])
    three_ranks = shard_grids({"model.layers.0.mlp.down_proj.weight": grid(512, 1536, (256, 16))},
                              cfg, TensorParallel(rank=0, size=3, group=None))  # 512 columns a rank: 2 blocks
    assert three_ranks["model.layers.0.mlp.down_proj.weight"][0].shape == (512, 2)
    four_ranks = shard_grids({"model.layers.0.mlp.down_proj.weight": grid(512, 1536, (256, 16)),
                              "model.layers.0.self_attn.o_proj.weight": grid(512, 512, (32, 32))},
                             cfg, TensorParallel(rank=0, size=4, group=None))  # 384 columns: 1.5 blocks of 256
    assert list(four_ranks) == ["model.layers.0.self_attn.o_proj.weight"]
