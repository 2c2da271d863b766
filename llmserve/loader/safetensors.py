"""Hugging Face model directories: config.json, *.safetensors, tokenizer.json, tokenizer_config.json.

A directory whose config.json has an AWQ or GPTQ `quantization_config` (AutoAWQ's GEMM layout, see awq_format.py;
GPTQ's, gptq_format.py, also found in AutoGPTQ's quantize_config.json) loads with its int4 groups as they are stored,
so the int4 path runs them without re-quantizing; one in
compressed-tensors' int8 layout (int8_format.py) loads as q * scale, which the int8 path fits back to the
same q and scale; an FP8 one (vLLM's, DeepSeek's, compressed-tensors' float-quantized: fp8_format.py) as q * scale
with its scales kept for the fp8 layers (`Checkpoint.fp8_grids`)."""

from __future__ import annotations

import glob
import json
import os

from safetensors.torch import load_file
from tqdm import tqdm

from llmserve.loader.awq_format import AWQ_FORMAT, read_awq_tensors
from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.fp8_format import FP8_FORMAT, is_fp8_config, read_fp8_tensors
from llmserve.loader.gptq_format import GPTQ_FORMAT, read_gptq_tensors
from llmserve.loader.int8_format import INT8_FORMAT, read_int8_tensors
from llmserve.models.families import canonical_tensors, config_from_hf


def load_hf_dir(path: str, name: str, tokenizer: object | None = None) -> Checkpoint:
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    config = config_from_hf(hf)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    weights = {}
    for file in tqdm(files, desc=f"Loading {name}", unit="file"):
        weights.update(load_file(file))
    formats, grids, groups, fp8_grids = None, None, None, None
    quant = hf.get("quantization_config") or _quantize_config_json(path)
    if quant is not None:  # the quantized linears as their dequantized values, with how they were stored
        method = quant.get("quant_method")
        if method in ("awq", "gptq"):
            weights, groups = (read_awq_tensors if method == "awq" else read_gptq_tensors)(weights, quant)
            quantized, stored_as = set(groups), AWQ_FORMAT if method == "awq" else GPTQ_FORMAT
            grids = {k: g.grid32() for k, g in groups.items()}
        elif is_fp8_config(quant):  # vLLM's and DeepSeek's fp8, compressed-tensors' float-quantized
            weights, quantized, fp8_grids = read_fp8_tensors(weights, quant)
            stored_as = FP8_FORMAT
        elif method == "compressed-tensors":
            weights, quantized = read_int8_tensors(weights, quant)
            stored_as = INT8_FORMAT
        else:
            raise ValueError(f"{path}: quantization_config {method!r} is not supported (awq, gptq, fp8 and "
                             "compressed-tensors int8 or float-quantized are)")
        formats = {k: stored_as if k in quantized else str(v.dtype).removeprefix("torch.") for k, v in weights.items()}
    # the family's own tensor names and fusions as Llama's (Mixtral's experts, Phi-3's fused q/k/v), for the decoder
    weights, grids, formats, fp8_grids = (canonical_tensors(d, config) if d else d
                                          for d in (weights, grids, formats, fp8_grids))

    if tokenizer is None:  # else one already read from these files (see `load_checkpoint`)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    return Checkpoint(
        name=name,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
        eos_token_ids=_eos_ids(path, hf, tokenizer),
        source_formats=formats,
        int4_grids=grids,
        int4_groups=groups,
        fp8_grids=fp8_grids,
    )


def _quantize_config_json(path: str) -> dict | None:
    """AutoGPTQ's quantize_config.json (older GPTQ checkpoints have it instead of config.json's quantization_config),
    or None."""
    try:
        with open(os.path.join(path, "quantize_config.json")) as f:
            return {"quant_method": "gptq", **json.load(f)}
    except FileNotFoundError:
        return None


def _eos_ids(path: str, hf: dict, tokenizer) -> list[int]:
    ids: list[int] = []
    sources = [hf.get("eos_token_id")]
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            sources.insert(0, json.load(f).get("eos_token_id"))
    sources.append(tokenizer.eos_token_id)
    for s in sources:
        for i in s if isinstance(s, list) else [s]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids
