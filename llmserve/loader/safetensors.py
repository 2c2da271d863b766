"""Hugging Face model directories: config.json, *.safetensors, tokenizer.json, tokenizer_config.json.

A directory whose config.json has an AWQ `quantization_config` (AutoAWQ's GEMM layout, see awq_format.py)
loads with its int4 groups as they are stored, so the int4 path runs them without re-quantizing; one in
compressed-tensors' int8 layout (int8_format.py) loads as q * scale, which the int8 path fits back to the
same q and scale."""

from __future__ import annotations

import glob
import json
import os

from safetensors.torch import load_file
from tqdm import tqdm

from llmserve.loader.awq_format import AWQ_FORMAT, read_awq_tensors
from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.int8_format import INT8_FORMAT, read_int8_tensors
from llmserve.models.llama import LlamaConfig


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
    formats, grids, groups = None, None, None
    quant = hf.get("quantization_config")
    if quant is not None:  # the quantized linears as their dequantized values, with how they were stored
        method = quant.get("quant_method")
        if method == "awq":
            weights, groups = read_awq_tensors(weights, quant)
            quantized, stored_as = set(groups), AWQ_FORMAT
            grids = {k: g.grid32() for k, g in groups.items()}
        elif method == "compressed-tensors":
            weights, quantized = read_int8_tensors(weights, quant)
            stored_as = INT8_FORMAT
        else:
            raise ValueError(f"{path}: quantization_config {method!r} is not supported (awq and compressed-tensors "
                             "int8 are)")
        formats = {k: stored_as if k in quantized else str(v.dtype).removeprefix("torch.") for k, v in weights.items()}

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
    )


def config_from_hf(hf: dict) -> LlamaConfig:
    """LlamaConfig from a config.json dict (transformers 4 and 5 spellings of RoPE settings)."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    rope_params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
    heads = hf["num_attention_heads"]
    if hf.get("sliding_window") and hf.get("use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf.get("rope_theta") or rope_params.get("rope_theta", 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        rope_scaling=scaling,
        architecture=arch,
    )


def config_to_hf(config: LlamaConfig) -> dict:
    """A config.json dict for this model (`config_from_hf`'s inverse, transformers' keys)."""
    hf = {
        "architectures": [config.architecture],
        "model_type": "qwen2" if config.architecture == "Qwen2ForCausalLM" else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_scaling": config.rope_scaling,
    }
    if config.architecture != "Qwen2ForCausalLM":
        hf["attention_bias"] = config.attention_bias
    return hf


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
