"""What every loader returns: one in-memory model description, whatever the file format."""

from __future__ import annotations

from collections import UserDict
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass

import torch

from llmserve.models.config import ModelConfig
from llmserve.quantization.int4_groups import Int4Groups


class LazyTensors(MutableMapping):
    """Tensors by name, each made (a GGUF tensor decoded) only when taken. Why: the model takes them one at a time
    and releases each (`DecoderForCausalLM.load_weights`), so the start's peak holds one decoded tensor, not the
    whole float32 checkpoint (7.1 GB for a 1.5B model, twice what the served model holds). Reading a tensor twice
    decodes it twice."""

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]) -> None:
        self._makers = makers

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._makers[name] = lambda: tensor

    def __delitem__(self, name: str) -> None:
        del self._makers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def clear(self) -> None:  # without making each first, as the mixin's would
        self._makers.clear()


class LazyGrids(UserDict):
    """A file's own grids (`Checkpoint.int4_grids`, `int8_grids`), read when first used: a start that maps its
    prepared weights (quantization/prepared_cache.py) never uses them, and reading them touches every page of the
    file (~1.5 s of Qwen2.5-Coder-1.5B's start on a Zen 4 host). Pickled as the dict it holds."""

    def __init__(self, read: Callable[[], dict]) -> None:  # not UserDict's own, which would set `data`
        self._read: Callable[[], dict] | None = read
        self._data: dict = {}

    @property
    def data(self) -> dict:
        if self._read is not None:
            self._data, self._read = self._read(), None
        return self._data

    @data.setter
    def data(self, value: dict) -> None:
        self._data, self._read = value, None

    def __reduce__(self) -> tuple:
        return dict, (dict(self.data),)


@dataclass
class Checkpoint:
    name: str
    config: ModelConfig
    weights: MutableMapping[str, torch.Tensor]  # Hugging Face tensor names, dense (a GGUF's made as taken)
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
    # the file's own grid for tensors stored in more than 4 bits that int8 holds exactly: Q6_K's d per 256 inputs
    # (float32 [out, in / 256]) and int8 sc per 16 ([out, in / 16]), w = d * sc * (q - 32), q in [0, 63]; or Q8_0's
    # and Q5_0's d per 32 inputs alone (a 1-tuple, float32 [out, in / 32]), w = d * q, q in [-128, 127]. The int8
    # layers' native kernel computes with these values (6.625 or 8.5 bits a weight) instead of re-quantizing them
    # to 8 bits per row.
    int8_grids: dict[str, tuple[torch.Tensor, ...]] | None = None
    # weights on int4 groups of any size in AWQ's form (w = (q - z) * s): an AWQ-layout checkpoint's, or what
    # AWQ / round to nearest made in memory (quantization/quantize_checkpoint.py). Their dequantized values
    # are in `weights` and their per-32 form in `int4_grids`; kept whole so that `llmserve quantize` can
    # write them as they are.
    int4_groups: dict[str, Int4Groups] | None = None
    # an FP8 checkpoint's scales (loader/fp8_format.py): float32 [out, ceil(in / 128)], one per row and block of 128
    # inputs, w = q * scale with q e4m3. The fp8 layers keep the file's bytes and scales with them.
    fp8_grids: dict[str, tuple[torch.Tensor]] | None = None

    @property
    def grids(self) -> dict[str, dict[str, tuple[torch.Tensor, ...]]]:
        """The file's own grids by the weight format that keeps them (quantization/methods/)."""
        return {"int4": self.int4_grids or {}, "int8": self.int8_grids or {}, "fp8": self.fp8_grids or {}}
