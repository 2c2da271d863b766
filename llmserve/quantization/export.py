"""Write an int4 checkpoint as a Hugging Face directory in AutoAWQ's or GPTQ's layout.

Why those layouts: they are the int4 formats other servers load (vLLM, transformers, TGI, SGLang: `quant_method:
awq` or `gptq`), and both hold any group size with integer zero points, which is what AWQ, GPTQ and round to nearest
produce here (loader/awq_format.py, loader/gptq_format.py). The directory: model.safetensors (each decoder linear as
qweight / qzeros / scales (/ g_idx), its bias beside it; every other tensor, folded norms included, as the checkpoint
holds it), config.json with the `quantization_config` (GPTQ's also as quantize_config.json, where AutoGPTQ looks),
generation_config.json (the end-of-sequence ids), and the tokenizer with its chat template. `llmserve serve DIR`
reads it back to the same values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmserve.loader.awq_format import pack_awq
from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.gptq_format import pack_gptq
from llmserve.models.families import config_to_hf


def save_int4_checkpoint(ckpt: Checkpoint, out_dir: str | Path, provenance: dict[str, Any] | None = None,
                         gptq: dict[str, Any] | None = None) -> Path:
    """Write `ckpt` (its decoder linears on `int4_groups`) to `out_dir`, in AutoAWQ's layout, or GPTQ's where `gptq`
    is its `quantization_config` (`gptq_format.quantization_config`); `provenance`: how it was made, kept under
    config.json's "llmserve_quantization". Returns the directory."""
    if not ckpt.int4_groups:
        raise ValueError("the checkpoint has no int4 groups to write: quantize it first (quantize_checkpoint)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    group_sizes = {g.group_size for g in ckpt.int4_groups.values()}
    if len(group_sizes) != 1:
        raise ValueError(f"an int4 layout has one group size per checkpoint, these weights have {sorted(group_sizes)}")
    group_size = group_sizes.pop()
    if gptq is not None and gptq["group_size"] != group_size:
        raise ValueError(f"the GPTQ config says group size {gptq['group_size']}, the weights have {group_size}")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.weights.items():
        if name in ckpt.int4_groups:
            prefix = name.removesuffix(".weight")
            groups = ckpt.int4_groups[name]
            packed = pack_awq(groups) if gptq is None else pack_gptq(groups, gptq["checkpoint_format"])
            tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
        else:
            tensors[name] = tensor.contiguous()
    dense = {t.dtype for n, t in ckpt.weights.items() if n not in ckpt.int4_groups and t.is_floating_point()}
    torch_dtype = str(max(dense, key=lambda d: d.itemsize)).removeprefix("torch.") if dense else "float16"
    write_directory(ckpt, out, tensors, torch_dtype, gptq or {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None}, provenance)
    if gptq is not None:
        (out / "quantize_config.json").write_text(json.dumps(gptq, indent=2) + "\n")
    return out


def write_directory(ckpt: Checkpoint, out: Path, tensors: dict[str, torch.Tensor], torch_dtype: str,
                    quantization_config: dict[str, Any], provenance: dict[str, Any] | None = None) -> None:
    """What every checkpoint `llmserve quantize` writes holds beside its tensors' layout: `tensors` as
    model.safetensors, config.json (the model, `torch_dtype`, the end-of-sequence ids, `quantization_config`, and
    `provenance` under "llmserve_quantization"), generation_config.json, and the tokenizer with its chat template."""
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(ckpt.config)
    hf["torch_dtype"] = torch_dtype
    hf["eos_token_id"] = ckpt.eos_token_ids[0] if len(ckpt.eos_token_ids) == 1 else ckpt.eos_token_ids
    hf["quantization_config"] = quantization_config
    if provenance:
        hf["llmserve_quantization"] = provenance
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ckpt.eos_token_ids}, indent=2) + "\n")
    tokenizer = ckpt.tokenizer
    if ckpt.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = ckpt.chat_template
    tokenizer.save_pretrained(str(out))
