"""/v1/embeddings: `llmserve serve all-minilm-l6-v2` answers with the vectors sentence-transformers computes for the
same texts, in float or base64, batched; what it cannot honour (token ids, fewer dimensions) is refused; a
text-generation server refuses the endpoint and an embedding server the text-generation ones."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from llmserve.embeddings import Embedder
from llmserve.evaluate.datasets import MINILM, package_file
from llmserve.server.errors import APIError
from llmserve.server.protocol import EmbeddingRequest
from llmserve.server.serving_embedding import OpenAIServingEmbedding
from llmserve.server.serving_engine import ModelInfo
from tests.server.conftest import MODEL, ServerProcess

NAME = "all-minilm-l6-v2"
TEXTS = ["The cat sat on the mat.", "A feline rested on the rug.", "Quarterly revenue rose by 4 percent.",
         "word " * 400]  # the last past the model's 256 tokens: cut there, as sentence-transformers cuts it


@pytest.fixture(scope="module")
def serving() -> OpenAIServingEmbedding:
    return OpenAIServingEmbedding(Embedder(name=NAME), ModelInfo(served_names=[NAME], max_model_len=256))


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(package_file(MINILM)), device="cpu").encode(TEXTS, normalize_embeddings=True)


def _create(serving: OpenAIServingEmbedding, **body):
    return asyncio.run(serving.create(EmbeddingRequest(**{"model": NAME, **body})))


def test_vectors_equal_sentence_transformers_in_float_and_base64(serving, reference):
    floats = _create(serving, input=TEXTS)
    vectors = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and vectors.shape == (len(TEXTS), 384)
    assert ((vectors * reference).sum(1) >= 0.9999).all()
    encoded = _create(serving, input=TEXTS, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in encoded.data])
    np.testing.assert_array_equal(decoded, vectors)
    tokenizer = serving.embedder._tokenizer
    expected_tokens = sum(min(len(tokenizer(t)["input_ids"]), 256) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == expected_tokens
    [alone] = _create(serving, input=TEXTS[2], dimensions=384).data  # one string; its own dimensions allowed
    np.testing.assert_allclose(alone.embedding, vectors[2], atol=1e-5)


@pytest.mark.parametrize(("body", "needle"), [
    ({"input": [[101, 2023, 102]]}, "token ids"),
    ({"input": [1, 2, 3]}, "token ids"),
    ({"input": []}, "must not be empty"),
    ({"input": ["ok", ""]}, "must not be empty"),
    ({"input": "x", "dimensions": 128}, "384 dimensions"),
    ({"input": ["x"] * 2049}, "at most 2048"),
    ({"input": "x", "model": "text-embedding-3-small"}, "does not exist"),
])
def test_what_cannot_be_honoured_is_refused(serving, body, needle):
    with pytest.raises(APIError, match=needle):
        _create(serving, **body)


def test_a_text_generation_server_refuses_embeddings(server: ServerProcess):
    r = httpx.post(f"{server.base}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
    assert "llmserve serve all-minilm-l6-v2" in r.json()["error"]["message"]


def test_served_by_name_to_the_official_client(embedding_server: ServerProcess, reference):
    client = openai.OpenAI(base_url=f"{embedding_server.base}/v1", api_key="unused", max_retries=0, timeout=60)
    response = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert ((vectors * reference).sum(1) >= 0.9999).all() and response.usage.prompt_tokens > 0
    assert [m.id for m in client.models.list().data] == [NAME] and client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}])
    assert httpx.get(f"{embedding_server.base}/health", timeout=10).status_code == 200
