"""torch.compile'd engines: the same greedy tokens as transformers, in batched and single steps.

Native attention compiles each decode-only step as one graph (engine/decode_graph.py); the PyTorch
attention path compiles each decoder layer with attention left eager."""

from __future__ import annotations

import pytest

from llmserve import LLM
from tests.greedy import assert_greedy_equals

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_compiled_engine_matches_transformers(kernels, prompt_token_ids, hf_reference):
    # at most 8 sequences: the warm-up compiles the classes of 1 and of a few tokens, all these batches take
    # (tests/quantization/test_int8_activations.py compiles the classes past 8 and 16)
    llm = LLM(dtype="float32", quantization="none", compile=True, kernels=kernels, kv_cache_memory_gb=0.25,
              max_model_len=2048, max_num_seqs=len(prompt_token_ids))
    assert (llm.engine.runner.decode_graph is not None) == (kernels == "native")
    assert llm.engine.plan.compile == ("graph" if kernels == "native" else "layers")
    # the warm-up ran before serving and left nothing behind
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    assert llm.engine.kv_cache.stats.queries == 0
    assert_greedy_equals(llm, prompt_token_ids, hf_reference, single=2)
    if kernels == "native":  # after warm-up, decode steps called the compiled code directly
        assert {1, len(prompt_token_ids)} <= llm.engine.runner.decode_graph.direct_batch_sizes
