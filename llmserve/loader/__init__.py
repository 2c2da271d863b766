"""Load a checkpoint (GGUF file or Hugging Face directory) and build the model from it."""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.default_models import resolve_model_path
from llmserve.models.llama import LayerMethods
from llmserve.models.registry import model_class

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "load_checkpoint", "load_tokenizer", "build_model"]


def load_checkpoint(model: str | None) -> Checkpoint:
    path, name = resolve_model_path(model)
    start = time.perf_counter()
    if os.path.isdir(path):
        from llmserve.loader.safetensors import load_hf_dir

        ckpt = load_hf_dir(path, name)
    elif path.endswith(".gguf"):
        from llmserve.loader.gguf import load_gguf

        ckpt = load_gguf(path, name)
    else:
        raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model directory")
    logger.info("loaded %s (%s) in %.1fs", name, path, time.perf_counter() - start)
    return ckpt


def load_tokenizer(model: str | None):
    """The tokenizer alone (no weights): a registered name's, a GGUF file's or a HF directory's."""
    path, _ = resolve_model_path(model)
    if os.path.isdir(path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from llmserve.loader.gguf import gguf_tokenizer

    return gguf_tokenizer(path)


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: str, methods: LayerMethods | None = None) -> nn.Module:
    """The model of this checkpoint, its weights loaded; `methods`: how its layers compute (the build
    plan's choice; default PyTorch's attention and ops).

    Memory: a GGUF arrives dequantized to float32 (7.1 GB for a 1.5B model). Its tensors are cast to the
    model's dtype one at a time, the parameters are created in that dtype (not in float32 first), and
    `load_weights` takes the tensors out of `ckpt` as it copies them, so the peak is about two bf16
    copies of the model instead of two float32 ones plus a bf16 one."""
    for name, tensor in ckpt.weights.items():  # replacing values, not keys: safe while iterating
        ckpt.weights[name] = tensor.to(dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the parameters' initial values are overwritten below anyway
    try:
        model = model_class(ckpt.config)(ckpt.config, methods)
    finally:
        torch.set_default_dtype(default)
    model = model.to(device=device, dtype=dtype)  # the buffers: rotary tables, computed in float32
    model.load_weights(ckpt.weights)
    return model.eval().requires_grad_(False)
