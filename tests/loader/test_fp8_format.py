"""FP8 checkpoints read: the values are those an independent reader computes, block scales at edges that are not
multiples of 128 included, and a file we cannot read is refused by name.

The independent reader is compressed-tensors' own `dequantize` (its float-quantized formats' decompression, pure
PyTorch, on the CPU), with each layout's strategy: tensor, channel and block (which pads the edges as DeepSeek's
scales do). transformers' fp8 integration reading a whole DeepSeek-style directory on the CPU is checked in
tests/quantization/test_fp8.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from llmserve.loader import load_checkpoint
from llmserve.loader.fp8_format import FP8_FORMAT, is_fp8_config, read_fp8_tensors
from tests.quantization.tiny_models import make_tiny_hf_dir

DEEPSEEK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
VLLM = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _compressed(strategy: str, **weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                     "dynamic": True},
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                    **weights}}}}


def _fp8(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random e4m3 bytes over the whole range (subnormals and +-448 included), no NaN."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(out_features, in_features, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    q.view(torch.uint8)[0, :6] = torch.tensor([0x00, 0x01, 0x07, 0x81, 0x7E, 0xFE], dtype=torch.uint8)
    return q


def _independent(q: torch.Tensor, scale: torch.Tensor, strategy: str) -> torch.Tensor:
    """compressed-tensors' own dequantization of the weight (`pip install --no-deps compressed-tensors loguru`)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                            block_structure=[128, 128] if strategy == "block" else None)
    return dequantize(q, scale, args=args, dtype=torch.float32)


@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (48, 130)])
def test_block_scales_at_edges_not_multiples_of_128_equal_compressed_tensors(shape):
    out_features, in_features = shape
    q = _fp8(out_features, in_features)
    scale = torch.rand(-(-out_features // 128), -(-in_features // 128)) * 1e-3 + 1e-5
    name = "model.layers.0.mlp.down_proj.weight"
    weights, quantized, grids = read_fp8_tensors({name: q, f"{name}_scale_inv": scale}, DEEPSEEK)
    assert quantized == {name} and set(weights) == {name}
    assert torch.equal(weights[name], _independent(q, scale, "block"))
    # the grid: each row's scale per block of 128 inputs (rows 128.. take the second row of blocks)
    (grid,) = grids[name]
    assert grid.shape == (out_features, -(-in_features // 128))
    assert torch.equal(grid[out_features - 1], scale[-1]) and torch.equal(grid[0], scale[0])


@pytest.mark.parametrize("layout", ["tensor", "channel", "vllm-tensor"])
def test_per_tensor_and_per_channel_scales_equal_compressed_tensors(layout):
    q = _fp8(96, 160, seed=1)
    strategy = "tensor" if layout != "channel" else "channel"
    scale = torch.rand(96, 1) * 1e-2 + 1e-4 if strategy == "channel" else torch.tensor([3.7e-3])
    name = "model.layers.1.self_attn.q_proj.weight"
    config = VLLM if layout == "vllm-tensor" else _compressed(strategy)
    assert is_fp8_config(config)
    tensors = {name: q, f"{name}_scale": scale, "model.layers.1.self_attn.q_proj.input_scale": torch.tensor([0.5]),
               "model.norm.weight": torch.ones(96)}
    weights, quantized, grids = read_fp8_tensors(tensors, config)
    assert set(weights) == {name, "model.norm.weight"}  # the activation scale dropped, the norm kept
    assert torch.equal(weights[name], _independent(q, scale, strategy))
    assert torch.equal(grids[name][0], scale.view(-1, 1).expand(96, 2))


def test_compressed_tensors_int8_is_not_read_as_fp8():
    int8 = _compressed("channel")
    int8["format"] = "int-quantized"
    int8["config_groups"]["group_0"]["weights"]["type"] = "int"
    assert not is_fp8_config(int8) and not is_fp8_config({"quant_method": "awq"})


def _directory(tmp_path, tensors_changed, config: dict):
    """A tiny Llama directory, its first q_proj stored as fp8 with a per-channel scale, then changed."""
    path = make_tiny_hf_dir(tmp_path, "llama", kv_heads=2)
    name = "model.layers.0.self_attn.q_proj.weight"
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    scale = tensors[name].abs().amax(dim=1, keepdim=True) / 448
    tensors[name], tensors[f"{name}_scale"] = (tensors[name] / scale).to(torch.float8_e4m3fn), scale
    tensors_changed(tensors, name)
    save_file(tensors, str(path / "model.safetensors"))
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(hf))
    return path, name, tensors


def test_a_directory_reads_its_fp8_weights_as_fp8(tmp_path):
    path, name, tensors = _directory(tmp_path, lambda t, n: None, _compressed("channel"))
    ckpt = load_checkpoint(str(path))
    assert ckpt.source_formats[name] == FP8_FORMAT
    assert ckpt.source_formats["model.layers.0.self_attn.k_proj.weight"] == "float32"
    assert torch.equal(ckpt.weights[name], tensors[name].float() * tensors[f"{name}_scale"])
    assert ckpt.grids["fp8"][name][0].shape == (128, 1)


@pytest.mark.parametrize(("change", "config", "message"), [
    (lambda t, n: t.pop(f"{n}_scale"), VLLM, "has no .*_scale"),
    (lambda t, n: t.update({n: t[n].bfloat16()}), VLLM, "has a weight scale but is bfloat16"),
    (lambda t, n: t.update({n: t[n].float().to(torch.float8_e5m2)}), VLLM, "float8_e5m2"),
    (lambda t, n: t.update({f"{n}_scale": torch.ones(3, 1)}), VLLM, "per output channel"),
    (lambda t, n: None, {**VLLM, "activation_scheme": "static"}, "static"),
    (lambda t, n: None, {**DEEPSEEK, "weight_block_size": [64, 64]}, r"blocks of \[rows, 128\]"),
    (lambda t, n: None, DEEPSEEK, r"block scales must be \[1, 1\]"),
    (lambda t, n: None, _compressed("channel") | {"config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "statically"),
], ids=["missing-scale", "wrong-dtype", "e5m2", "scale-shape", "static-activations", "block-64", "block-shape",
       "static-compressed"])
def test_a_bad_file_is_refused_with_a_clear_error(tmp_path, change, config, message):
    path, _, _ = _directory(tmp_path, change, config)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(path))
