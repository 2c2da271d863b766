"""Write FP8 (e4m3) weight-only checkpoints that vLLM loads (loader/fp8_format.py reads them back).

Two layouts, as published FP8 checkpoints are:
- per output channel (the default): compressed-tensors' `float-quantized` format, weights 8-bit float per channel,
  activations not quantized (what vLLM runs as W8A16-FP8): `P.weight` float8_e4m3fn [out, in], `P.weight_scale`
  float32 [out, 1], scale = max|row| / 448;
- blocks of 128 x 128 (`block=128`): DeepSeek-V3's, `quant_method: fp8` with `weight_block_size: [128, 128]`:
  `P.weight` float8_e4m3fn and `P.weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)], scale = max|block| / 448.
Every decoder linear is written so; the output head, embedding and norms as loaded. The weights are quantized from the
dtype they will be served in (`dtype`), as `--quantization fp8` would from the same model; any dtype reads back to the
written bytes and scales (the fp8 layers divide the values back to the same e4m3 bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmserve.kernels.fp8_gemv import FP8_BLOCK
from llmserve.loader.checkpoint import Checkpoint
from llmserve.quantization.export import write_directory
from llmserve.quantization.methods.fp8 import channel_scales, fp8_levels, quantize_fp8_blocks
from llmserve.quantization.quantize_checkpoint import is_decoder_linear

CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "group_size": None,
                    "block_structure": None, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["lm_head"],
}
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def save_fp8_checkpoint(ckpt: Checkpoint, out_dir: str | Path, dtype: torch.dtype, block: int | None = None,
                        provenance: dict[str, Any] | None = None) -> Path:
    """Every decoder linear of `ckpt` as e4m3 (from its values in `dtype`): per output channel, or in blocks of
    `block` x `block` weights (128 only: the kernel's scale width)."""
    if block not in (None, FP8_BLOCK):
        raise ValueError(f"fp8 blocks are {FP8_BLOCK} x {FP8_BLOCK} (DeepSeek's, the kernel's scale width), got "
                         f"{block}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.weights.items():
        if not is_decoder_linear(name):
            tensors[name] = tensor.contiguous()
            continue
        weight = tensor.to(dtype)
        if block is None:
            q, scales, _ = fp8_levels(weight, channel_scales(weight), check=False)
            tensors[f"{name}_scale"] = scales[:, :1].contiguous()
        else:
            q, tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(weight, block)
        tensors[name] = q.contiguous()
    write_directory(ckpt, out, tensors, str(dtype).removeprefix("torch."),
                    CHANNEL_CONFIG if block is None else BLOCK_CONFIG, provenance)
    return out
