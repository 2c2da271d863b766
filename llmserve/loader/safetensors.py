"""Hugging Face model directories: config.json, *.safetensors, tokenizer.json, tokenizer_config.json."""

from __future__ import annotations

import glob
import json
import os

from safetensors.torch import load_file
from tqdm import tqdm

from llmserve.loader.checkpoint import Checkpoint
from llmserve.models.llama import LlamaConfig


def load_hf_dir(path: str, name: str) -> Checkpoint:
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    config = config_from_hf(hf)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    weights = {}
    for file in tqdm(files, desc=f"Loading {name}", unit="file"):
        weights.update(load_file(file))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return Checkpoint(
        name=name,
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
        eos_token_ids=_eos_ids(path, hf, tokenizer),
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
