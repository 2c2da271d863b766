"""Load a checkpoint (GGUF file or Hugging Face directory) and build the model from it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.default_models import resolve_model_path
from llmserve.models.decoder import DecoderForCausalLM, LayerMethods

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "load_checkpoint", "load_tokenizer", "build_model", "same_tokenizer"]


def load_checkpoint(model: str | None, tokenizer: object | None = None) -> Checkpoint:
    """`tokenizer`: one already read from this model's tokenizer files (a draft's, see `same_tokenizer`), taken
    instead of reading them again (slow for a large vocabulary)."""
    path, name = resolve_model_path(model)
    start = time.perf_counter()
    if os.path.isdir(path):
        from llmserve.loader.safetensors import load_hf_dir

        ckpt = load_hf_dir(path, name, tokenizer)
    elif path.endswith(".gguf"):
        from llmserve.loader.gguf import load_gguf

        ckpt = load_gguf(path, name, tokenizer)
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


# what `AutoTokenizer` reads from a directory, beside the model's config
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model")


def tokenizer_files(model: str | None) -> dict[str, bytes]:
    """The files a model's tokenizer is read from, by name: a Hugging Face directory's, or a GGUF file's converted
    tokenizer in the cache (none before its first load)."""
    path, _ = resolve_model_path(model)
    if os.path.isdir(path):
        folder = path
    else:
        from llmserve.loader.gguf import tokenizer_cache_folder

        folder = tokenizer_cache_folder(path)
    files = {}
    for name in _TOKENIZER_FILES:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read()
        except FileNotFoundError:
            continue
    return files


def same_tokenizer(a: str | None, b: str | None) -> bool:
    """Whether two models' tokenizers are read from identical files (Qwen2.5-Coder-0.5B's and -1.5B's are): then
    one loaded tokenizer serves both."""
    files = tokenizer_files(a)
    return bool(files) and files == tokenizer_files(b)


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: str, methods: LayerMethods | None = None,
                on_layer_loaded: Callable[[nn.Module, int], None] | None = None) -> nn.Module:
    """The model of this checkpoint, its weights loaded; `methods`: how its layers compute (the build
    plan's choice; default PyTorch's attention and ops). `on_layer_loaded(model, i)`: called once decoder layer i
    holds its weights (a quantizer replacing them as the model loads).

    Memory: the parameters are created in the model's dtype (not in float32 first), and `load_weights` takes each
    tensor out of `ckpt` (a GGUF's decoded to float32 only then) and casts it into its parameter, so the peak holds the
    model and one decoded tensor; with `on_layer_loaded` quantizing, the dense layers never all exist either."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the parameters' initial values are overwritten below anyway
    try:
        model = DecoderForCausalLM(ckpt.config, methods)
    finally:
        torch.set_default_dtype(default)
    model = model.to(device=device, dtype=dtype)  # the buffers: rotary tables, computed in float32
    model.load_weights(ckpt.weights, None if on_layer_loaded is None else lambda i: on_layer_loaded(model, i))
    return model.eval().requires_grad_(False)
