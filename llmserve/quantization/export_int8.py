"""Write int8 weight-only checkpoints (per output channel, symmetric) in compressed-tensors' layout
(loader/int8_format.py says why that layout, and reads it back).

The weights are quantized from the dtype they will be served in (`dtype`): our int8 layers fit each row's
scale to the weights as built, and a row written as q * scale from those same values fits back to the
same q and scale (its largest |q| is 127), so the served values are the written ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.int8_format import QUANTIZATION_CONFIG
from llmserve.quantization.export import write_directory
from llmserve.quantization.int8_activations import quantize_rows
from llmserve.quantization.quantize_checkpoint import is_decoder_linear


def save_int8_checkpoint(ckpt: Checkpoint, out_dir: str | Path, dtype: torch.dtype,
                         provenance: dict[str, Any] | None = None) -> Path:
    """Every decoder linear of `ckpt` as int8 per channel (from its values in `dtype`), the rest as stored."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.weights.items():
        if is_decoder_linear(name):
            q, scale = quantize_rows(tensor.to(dtype).float())
            tensors[name], tensors[f"{name}_scale"] = q.contiguous(), scale.float().contiguous()
        else:
            tensors[name] = tensor.contiguous()
    write_directory(ckpt, out, tensors, str(dtype).removeprefix("torch."), QUANTIZATION_CONFIG, provenance)
    return out
