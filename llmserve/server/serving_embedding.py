"""/v1/embeddings for a server that serves a sentence-embedding model (`llmserve serve all-minilm-l6-v2`).

Every text of a request goes through the model in one batch, in the embedder's own worker thread (the event
loop keeps serving). What the model cannot honour is refused, not approximated: token-id input (ids of another
tokenizer, such as the ones langchain's OpenAIEmbeddings sends by default, would embed nonsense), and a
`dimensions` other than the model's own.
"""

from __future__ import annotations

import base64

import numpy as np

from llmserve.embeddings import Embedder
from llmserve.server.errors import APIError
from llmserve.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from llmserve.server.serving_engine import ModelInfo, check_model

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


class OpenAIServingEmbedding:
    def __init__(self, embedder: Embedder, info: ModelInfo) -> None:
        self.embedder = embedder
        self.info = info

    async def create(self, request: EmbeddingRequest) -> EmbeddingResponse:
        model = check_model(self.info, request.model)
        texts = _texts(request.input)
        if request.dimensions is not None and request.dimensions != self.embedder.dim:
            raise APIError(400, f"dimensions: {model} embeds in {self.embedder.dim} dimensions and cannot shorten "
                           "them", param="dimensions")
        vectors, tokens = await self.embedder.aembed_counted(texts)
        return EmbeddingResponse(model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
                                 data=[EmbeddingData(index=i, embedding=_encoded(v, request.encoding_format))
                                       for i, v in enumerate(vectors)])


def _texts(given: str | list) -> list[str]:
    texts = [given] if isinstance(given, str) else given
    if not texts:
        raise APIError(400, "input must not be empty", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "input: only text is embedded here; token ids (of another tokenizer, such as "
                       "langchain's OpenAIEmbeddings sends unless check_embedding_ctx_length=False) are refused",
                       param="input")
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"input: at most {MAX_INPUTS} texts a request, got {len(texts)}", param="input")
    if any(not t for t in texts):
        raise APIError(400, "input: a text must not be empty", param="input")
    return texts


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what the openai client asks for by default, and decodes with numpy
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
