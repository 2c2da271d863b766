"""llmserve: self-hosted LLM serving. The offline API keeps vLLM's names."""

from llmserve.llm import LLM
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
