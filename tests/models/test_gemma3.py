"""A second real family: Gemma 3 270M (base; GGUF Q4_K_M from its PyPI part packages; setup assembles it). Its
local/global layers, query/key norms, sandwich norms and scaled embeddings come from its description, not from
branches of the Llama path. Greedy output equals transformers loading the same GGUF (as loaded, with a prompt
past the 512-token window of its local layers), and on the default's weights (every weight at the file's values
on the int4 and int8 grids) equals transformers on the same quantized weights."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.evaluate.reference import quantized_reference, reference_greedy
from llmserve.kernels import native_quantized_kernels
from tests.greedy import assert_fused_equals_layer_by_layer, assert_greedy_equals
from tests.model_files import GEMMA3, GEMMA3_MARKS

pytestmark = GEMMA3_MARKS
PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


@pytest.fixture(scope="module")
def gemma_fp32() -> LLM:
    return LLM(GEMMA3, dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts(gemma_fp32) -> list[list[int]]:
    processor = gemma_fp32.engine.processor
    ids = [processor.encode(p) for p in PROMPTS]
    return ids + [ids[2] + ids[2][1:] * 28]  # ~550 tokens: the local layers' window of 512 drops keys


def test_gemma3_greedy_equals_transformers_on_the_same_gguf(gemma_fp32, gemma3_reference, prompts):
    cfg = gemma_fp32.engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.vocab_size == 262_144
    assert cfg.layer_windows.count(512) == 15 and cfg.layer_windows.count(0) == 3 and len(prompts[3]) > 512
    expected = [reference_greedy(gemma3_reference, ids, 16) for ids in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)
    assert_greedy_equals(gemma_fp32, prompts, expected, single=3)


def test_gemma3_default_weights_equal_transformers_on_the_same_quantized_weights(gemma3_reference, gemma3_checkpoint,
                                                                                  prompts):
    ref = quantized_reference(gemma3_reference, "int4+int8", gemma3_checkpoint.grids)
    expected = [reference_greedy(ref, ids, 16) for ids in prompts[:3]]
    llm = LLM(GEMMA3, dtype="float32", quantization="int4+int8", kv_cache_memory_gb=0.25, max_model_len=1024)
    assert llm.engine.plan.weights == "int4+int8" and llm.engine.plan.fused_decode_max_tokens == 0
    assert_greedy_equals(llm, prompts[:3], expected)


@pytest.mark.skipif(not native_quantized_kernels(), reason="the one native call needs the native int4 kernels")
def test_gemma3_default_decodes_in_one_native_call_as_its_layers_do(prompts):
    """The default configuration's decode steps as one native call (Gemma 3's norms, gate, embeddings, windows and
    local rotary table as the stack's fields): its layer-by-layer forward's tokens and log-probabilities."""
    llm = LLM(GEMMA3, kv_cache_memory_gb=0.25, max_model_len=1024, enable_prefix_caching=False)
    assert llm.engine.runner.fused_stack is not None
    assert_fused_equals_layer_by_layer(llm, prompts[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                        logprobs=3))
