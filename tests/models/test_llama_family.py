"""Tiny randomly initialised checkpoints saved as Hugging Face directories (made here, no download):
our greedy output equals transformers' for Qwen2 (q/k/v bias) and Llama-3 RoPE scaling."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from llmserve import LLM, SamplingParams
from llmserve.evaluate.reference import reference_greedy

VOCAB = 49152  # the default model's tokenizer is reused, so the vocabulary matches it


def _tiny_configs():
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    return {
        "qwen2": Qwen2Config(**common, rope_theta=1_000_000.0, tie_word_embeddings=False),
        "llama3-scaled": LlamaConfig(
            **common, tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            rope_theta=500_000.0,
        ),
    }


@pytest.mark.parametrize("kind", ["qwen2", "llama3-scaled"])
def test_tiny_hf_directory_matches_transformers(kind, tmp_path, llm_fp32, prompt_token_ids):
    torch.manual_seed(0)
    config = _tiny_configs()[kind]
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init, so tokens vary; biases not zero
        for name, p in reference.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    reference.save_pretrained(tmp_path)
    llm_fp32.get_tokenizer().save_pretrained(tmp_path)

    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gb=0.05)
    assert llm.engine.model_config.attention_bias == (kind == "qwen2")
    assert (llm.engine.model_config.rope_scaling is not None) == (kind == "llama3-scaled")
    prompts = [ids for ids in prompt_token_ids if len(ids) < 400][:4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    expected = [reference_greedy(reference, ids, 24) for ids in prompts]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len({tuple(e) for e in expected}) > 1  # the check is not vacuous
    if kind == "qwen2":  # nor for the biases: without them the reference's tokens differ, so ours would fail
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
        assert [reference_greedy(reference, ids, 24) for ids in prompts] != expected
