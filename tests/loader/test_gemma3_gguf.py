"""GGUF metadata as transformers' config.json dict, and Gemma 3 270M's file read as transformers reads it: its
config, every tensor (names, the norms' +1 undone, no q/k permutation) and its SentencePiece tokenizer.

The llama and qwen2 files must give the engine exactly the config the loader built before it went through a
config.json dict: the values below are what it gave, field for field."""

from __future__ import annotations

import pytest
import torch

from llmserve.loader.default_models import resolve_model_path
from llmserve.loader.gguf import gguf_eos_ids, hf_config_from_metadata
from llmserve.loader.gguf_header import read_gguf_header
from llmserve.loader.safetensors import config_from_hf
from llmserve.models.config import ModelConfig
from tests.model_files import GEMMA3, GEMMA3_PATH, QWEN, QWEN_FILE, QWEN_PATH, needs_gemma3, needs_gemma3_file

_SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                head_dim=64, rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0, max_position_embeddings=8192,
                tie_word_embeddings=True, attention_bias=False, rope_scaling=None, architecture="LlamaForCausalLM")
_QWEN = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
             head_dim=64, rms_norm_eps=9.999999974752427e-07, rope_theta=1000000.0, max_position_embeddings=32768,
             tie_word_embeddings=False, attention_bias=True, rope_scaling=None, architecture="Qwen2ForCausalLM")

_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3
GEMMA3_HF_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "rms_norm_eps": 9.999999974752427e-07,  # the file's float32 1e-6
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rope_scaling": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "layer_types": _LAYER_TYPES,
    "rope_local_base_freq": 10000.0,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


def _hf_config(path: str) -> dict:
    header = read_gguf_header(path)
    return hf_config_from_metadata(header.metadata, header.metadata["general.architecture"], header.tensor_shapes)


@pytest.mark.parametrize("path, expected", [
    pytest.param(resolve_model_path(None)[0], _SMOLLM2, id="smollm2-135m"),
    pytest.param(QWEN_PATH and str(QWEN_PATH), _QWEN, id=QWEN, marks=QWEN_FILE),
])
def test_llama_and_qwen2_files_give_the_engine_the_config_they_gave_before(path, expected):
    config = config_from_hf(_hf_config(path))
    assert config == ModelConfig(**expected)
    assert config.beyond_llama == []


@needs_gemma3_file
def test_gemma3_metadata_is_transformers_config_dict():
    assert _hf_config(str(GEMMA3_PATH)) == GEMMA3_HF_CONFIG
    assert resolve_model_path(GEMMA3) == (str(GEMMA3_PATH), GEMMA3)


def test_an_end_of_turn_token_the_file_lists_ends_a_sequence_too():
    assert gguf_eos_ids({"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 106}) == [1, 106]
    assert gguf_eos_ids({"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 2}) == [2]
    assert gguf_eos_ids({}) == []


# `gemma3_reference` (transformers' Gemma3ForCausalLM from the same file) and `gemma3_checkpoint` (ours) are
# tests/conftest.py's, loaded once a session: tests/models/test_gemma3.py compares against the same reference.


@needs_gemma3
def test_gemma3_config_dict_reads_as_transformers_reads_the_file(gemma3_reference):
    from transformers import Gemma3TextConfig

    ours = Gemma3TextConfig(**GEMMA3_HF_CONFIG).to_dict()
    theirs = gemma3_reference.config.to_dict()
    for key in ("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar", "head_dim",
                "hidden_activation", "rms_norm_eps", "num_key_value_heads", "vocab_size", "tie_word_embeddings",
                "final_logit_softcapping", "attn_logit_softcapping", "max_position_embeddings", "model_type"):
        assert ours[key] == theirs[key], key


@needs_gemma3
def test_gemma3_tensors_equal_transformers(gemma3_checkpoint, gemma3_reference):
    """Every tensor, by transformers' name, exactly: the norms less the one llama.cpp added, q/k rows as stored
    (llama.cpp permutes Llama's only)."""
    reference = gemma3_reference.state_dict()
    weights = gemma3_checkpoint.weights
    assert set(reference) - set(weights) == {"lm_head.weight"}  # tied to the embedding
    assert set(weights) <= set(reference)
    for name, tensor in weights.items():
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name
    # the checkpoint was bfloat16: each norm comes back as a bfloat16 value, so +1 then -1 lost nothing
    norms = [t for name, t in weights.items() if name.endswith("norm.weight")]
    assert len(norms) == 18 * 6 + 1
    for t in norms:
        assert torch.equal(t.to(torch.bfloat16).float(), t)


@needs_gemma3
def test_gemma3_tokenizer_round_trips_with_gemma_s_special_ids(gemma3_checkpoint):
    tok = gemma3_checkpoint.tokenizer
    assert len(tok) == 262144
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == ("<bos>", 2, 1, 0)
    assert tok.convert_tokens_to_ids("<end_of_turn>") == 106
    # a base model: no chat template, and the file lists no end-of-turn id, so only <eos> ends a sequence
    assert gemma3_checkpoint.chat_template is None and tok.chat_template is None
    assert gemma3_checkpoint.eos_token_ids == [1]
    assert tok.encode("Hello, world!") == [2, 9259, 236764, 1902, 236888]
    for text in ["The quick brown fox jumps over the lazy dog.",
                 "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
                 "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
                 "  two leading spaces, naïve café — 日本語"]:
        ids = tok.encode(text)
        assert ids[0] == 2 and ids.count(2) == 1
        assert tok.decode(ids, skip_special_tokens=True) == text
