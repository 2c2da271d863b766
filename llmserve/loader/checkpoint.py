"""What every loader returns: one in-memory model description, whatever the file format."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.models.llama import LlamaConfig


@dataclass
class Checkpoint:
    name: str
    config: LlamaConfig
    weights: dict[str, torch.Tensor]  # Hugging Face tensor names, dense
    tokenizer: object  # a transformers fast tokenizer
    chat_template: str | None
    eos_token_ids: list[int]
    # how each tensor was stored (GGML type names such as "Q4_1", for a GGUF; None for dense files): what
    # the build plan reads to run a 4-bit file on the int4 path
    source_formats: dict[str, str] | None = None
    # the file's own 4-bit grid for tensors stored on one (Q4_0, Q4_1, Q4_K): per group of 32 inputs, the
    # scale and minimum with w = q * scale + min, q in [0, 15], float32 [out, in / 32]. The int4 path takes
    # its groups from here, so it holds the shipped values instead of re-fitting a grid to them.
    int4_grids: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
