"""Constrained decoding: outputs that match a JSON schema, a regex, a list of choices or a grammar."""

from llmserve.structured_output.manager import GrammarError, StructuredOutputManager

__all__ = ["GrammarError", "StructuredOutputManager"]
