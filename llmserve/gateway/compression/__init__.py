"""Prompt compression (the gateway's `compress` policy): drop a long context's least informative words, scored by a
small causal LM that the gateway serves (LLMLingua, Selective Context); keep the question and what must survive."""

from llmserve.gateway.compression.compressor import HEADER, Compression, Compressor
from llmserve.gateway.compression.policy import CompressPolicy

__all__ = ["HEADER", "CompressPolicy", "Compression", "Compressor"]
