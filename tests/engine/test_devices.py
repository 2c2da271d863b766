"""Every engine mode on every device present: the CPU always, CUDA where a GPU is (`LLM(device="cuda")`).

The model is made here (a tiny Qwen2 with q/k/v biases and GQA, and its own byte-level BPE tokenizer trained on
a few lines), so the module needs none of the shipped files and runs as it is on a GPU machine that has only
PyTorch and transformers. The reference is transformers on the same device, in float32: greedy tokens equal in
every mode that promises it (batched, alone, prefix-cached, chunked, preempted, speculative by n-gram and by a
draft model, compiled), every KV block back after a run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine import llm_engine
from llmserve.evaluate.reference import reference_greedy
from llmserve.sampling_params import StructuredOutputsParams
from tests.conftest import PROMPT_TEXTS
from tests.engine.test_kv_cache_dtype import MIN_TOP1, _top1_share
from tests.greedy import assert_greedy_equals
from tests.quantization.tiny_models import make_tiny_hf_dir, trained_tokenizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
# repeated phrases, so that prompt lookup finds n-grams to propose
CORPUS = PROMPT_TEXTS + [f"Step {i}: the model reads its weights, then the cache, then writes token {i}."
                         for i in range(64)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    tokenizer = trained_tokenizer(CORPUS)
    return str(make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-qwen2"), kind="qwen2", hidden=256, intermediate=512,
                                layers=3, tokenizer=tokenizer))


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.encode(t) for t in PROMPT_TEXTS]
    assert min(map(len, ids)) <= 4 and max(map(len, ids)) >= 150, sorted(map(len, ids))
    return ids


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(model_dir, prompts, device) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return [reference_greedy(model, ids, TOKENS) for ids in prompts]


def _llm(model_dir: str, device: str, **options) -> LLM:
    return LLM(model_dir, device=device, **{"dtype": "float32", "kv_cache_memory_gb": 0.02, "max_model_len": 1024,
                                            **options})


def test_greedy_equals_transformers_batched_and_alone(model_dir, device, prompts, reference):
    llm = _llm(model_dir, device)
    assert llm.engine.plan.device == device
    assert str(next(llm.engine.runner.model.parameters()).device).startswith(device)
    if device != "cpu":
        assert llm.engine.plan.attention == "torch" and llm.engine.plan.weights == "as loaded"
    assert_greedy_equals(llm, prompts, reference, single=1)


def test_cuda_graphs_keep_greedy_tokens(model_dir, device, prompts, reference, monkeypatch):
    # on CUDA the plan's own choice; on the CPU the same padded steps, forced, run eagerly (nothing captured):
    # what they check there is the padding (batch and context size classes, the spare block)
    if device == "cpu":
        resolve = llm_engine.resolve_plan
        monkeypatch.setattr(llm_engine, "resolve_plan",
                            lambda *args: dataclasses.replace(resolve(*args), cuda_graph_max_tokens=8))
    llm = _llm(model_dir, device, kernels="torch")
    graphs = llm.engine.runner.cuda_graphs
    assert llm.engine.plan.cuda_graph_max_tokens >= 8 and graphs.capture == (device == "cuda")
    assert_greedy_equals(llm, prompts, reference, single=0)
    # the 8 prompts together (their longest context 17 blocks: class 32), then the shortest alone (class 1 to 4)
    assert {batch for batch, _ in graphs.captured} == {1, 8} and len({b for _, b in graphs.captured}) >= 3
    # padded rows write to a block past the KV manager's, which the cache holds besides
    assert graphs.spare_block == llm.engine.kv_cache.num_blocks == llm.engine.runner.kv_caches[0][0].shape[0] - 1


def test_prefix_cache_chunks_and_preemption_keep_the_tokens(model_dir, device, prompts, reference):
    # 24 blocks of 16 tokens for 8 requests of up to ~230 tokens: requests are preempted; 32-token steps chunk
    # every long prompt; the second round finds the first's blocks
    block_bytes = 16 * 2 * 3 * 2 * 64 * 4
    llm = _llm(model_dir, device, kv_cache_memory_gb=24 * block_bytes / 2**30, max_num_batched_tokens=32,
               long_prefill_token_threshold=32)
    assert llm.engine.kv_cache.num_blocks == 24
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    [again] = llm.generate([prompts[-1]], GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == reference[-1] and again.num_cached_tokens >= 16
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_greedy_tokens(model_dir, device, prompts, reference, method):
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = model_dir  # the model drafting for itself: every proposal kept
    llm = _llm(model_dir, device, speculative_config=spec)
    assert_greedy_equals(llm, prompts, reference, single=6)
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if method == "draft_model":
        if device != "cpu":  # the draft's weights as loaded (on the CPU int4: tests/spec_decode/test_draft_model.py)
            assert stats.acceptance_rate > 0.9
        assert not llm.engine.speculator.proposer.engine.has_unfinished_requests()


def test_seeded_sampling_repeats_whatever_runs_beside_it(model_dir, device, prompts):
    llm = _llm(model_dir, device)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=TOKENS, ignore_eos=True)
    [alone] = llm.generate([prompts[2]], seeded, use_tqdm=False)
    together = llm.generate(prompts[:4], [GREEDY, GREEDY, seeded, SamplingParams(temperature=1.0, max_tokens=8)],
                            use_tqdm=False)
    assert together[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_structured_output_and_logprobs(model_dir, device, prompts):
    llm = _llm(model_dir, device)
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["the fox", "the dog"]))
    with_logprobs = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    picked, scored = llm.generate([prompts[1], prompts[1]], [choice, with_logprobs], use_tqdm=False)
    assert picked.outputs[0].text in ("the fox", "the dog")
    entries = scored.outputs[0].logprobs
    assert len(entries) == 8 and all(max(e.values(), key=lambda lp: lp.logprob).rank == 1 for e in entries)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_one_byte_kv_cache(model_dir, device, prompts, reference, kv):
    llm = _llm(model_dir, device, kv_cache_dtype=kv)
    assert _top1_share(llm, prompts, reference) >= MIN_TOP1[kv]
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_compiled_decode_keeps_greedy_tokens(model_dir, device, prompts, reference):
    if device == "cpu":
        pytest.skip("the CPU's compiled paths: tests/engine/test_compile.py (here it would only add minutes)")
    llm = _llm(model_dir, device, compile=True)
    assert llm.engine.plan.compile == "layers"
    assert_greedy_equals(llm, prompts, reference, single=1)


def test_default_dtype_on_the_device(model_dir, device, prompts, reference):
    # bfloat16 where the device multiplies it natively (CUDA; most CPUs here): no promise of transformers' float32
    # tokens, but its first token, where float32's best two are not within bfloat16's rounding, and every block
    llm = LLM(model_dir, device=device, kv_cache_memory_gb=0.02, max_model_len=1024)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    first = sum(o.outputs[0].token_ids[0] == ref[0] for o, ref in zip(outs, reference, strict=True))
    assert first >= len(prompts) - 1, (first, len(prompts))
    assert all(len(o.outputs[0].token_ids) == TOKENS for o in outs)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
