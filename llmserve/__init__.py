"""llmserve: self-hosted LLM serving. The offline API keeps vLLM's names.

Names are imported on first use, so `llmserve bench` and `llmserve --help` never pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmserve.llm import LLM
    from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
    from llmserve.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "llmserve.llm",
    "SamplingParams": "llmserve.sampling_params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "Logprob": "llmserve.outputs",
}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
