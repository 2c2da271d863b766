"""Write int8 weight-only checkpoints (per output channel, symmetric) in compressed-tensors' layout
(loader/int8_format.py says why that layout, and reads it back).

The weights are quantized from the dtype they will be served in (`dtype`): our int8 layers fit each row's
scale to the weights as built, and a row written as q * scale from those same values fits back to the
same q and scale (its largest |q| is 127), so the served values are the written ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.int8_format import QUANTIZATION_CONFIG
from llmserve.models.families import config_to_hf
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
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(ckpt.config)
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf["eos_token_id"] = ckpt.eos_token_ids[0] if len(ckpt.eos_token_ids) == 1 else ckpt.eos_token_ids
    hf["quantization_config"] = QUANTIZATION_CONFIG
    if provenance:
        hf["llmserve_quantization"] = provenance
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ckpt.eos_token_ids}, indent=2) + "\n")
    if ckpt.chat_template and not getattr(ckpt.tokenizer, "chat_template", None):
        ckpt.tokenizer.chat_template = ckpt.chat_template
    ckpt.tokenizer.save_pretrained(str(out))
    return out
