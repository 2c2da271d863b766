"""Write a quantized checkpoint as a Hugging Face directory in AutoAWQ's layout.

Why AutoAWQ's layout: it is the int4 format other servers load (vLLM, transformers, TGI: `quant_method:
awq`), and it holds any group size with integer zero points, which is what AWQ and round to nearest
produce here (loader/awq_format.py). The directory: model.safetensors (each decoder linear as qweight /
qzeros / scales, its bias beside it; every other tensor, folded norms included, as the checkpoint holds
it), config.json with the `quantization_config`, generation_config.json (the end-of-sequence ids), and
the tokenizer with its chat template. `llmserve serve DIR` reads it back to the same values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmserve.loader.awq_format import pack_awq
from llmserve.loader.checkpoint import Checkpoint
from llmserve.models.families import config_to_hf


def save_awq_checkpoint(ckpt: Checkpoint, out_dir: str | Path, provenance: dict[str, Any] | None = None) -> Path:
    """Write `ckpt` (its decoder linears on `int4_groups`) to `out_dir`; `provenance`: how it was made,
    kept under config.json's "llmserve_quantization". Returns the directory."""
    if not ckpt.int4_groups:
        raise ValueError("the checkpoint has no int4 groups to write: quantize it first (quantize_checkpoint)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    group_sizes = {g.group_size for g in ckpt.int4_groups.values()}
    if len(group_sizes) != 1:
        raise ValueError(f"AWQ's layout has one group size per checkpoint, these weights have {sorted(group_sizes)}")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.weights.items():
        if name in ckpt.int4_groups:
            prefix = name.removesuffix(".weight")
            tensors.update({f"{prefix}.{k}": v for k, v in pack_awq(ckpt.int4_groups[name]).items()})
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    dense = {t.dtype for n, t in ckpt.weights.items() if n not in ckpt.int4_groups and t.is_floating_point()}
    hf = config_to_hf(ckpt.config)
    hf["torch_dtype"] = str(max(dense, key=lambda d: d.itemsize)).removeprefix("torch.") if dense else "float16"
    hf["eos_token_id"] = ckpt.eos_token_ids[0] if len(ckpt.eos_token_ids) == 1 else ckpt.eos_token_ids
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_sizes.pop(),
                                 "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    if provenance:
        hf["llmserve_quantization"] = provenance
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ckpt.eos_token_ids}, indent=2) + "\n")
    tokenizer = ckpt.tokenizer
    if ckpt.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = ckpt.chat_template
    tokenizer.save_pretrained(str(out))
    return out
