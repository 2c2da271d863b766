"""The semantic cache over real MiniLM embeddings and real stores (in-process, and a real redis-server where
one is installed): paraphrases hit, other questions and other scopes miss, entries expire, and gateways that
share a store see each other's entries."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from llmserve.embeddings import Embedder
from llmserve.gateway.cache.semantic import SemanticCache
from llmserve.gateway.cache.store import MemoryStore, RedisStore, StoreUnavailable
from tests.gateway.conftest import free_port

QUESTION = "How do I reverse a list in Python?"
PARAPHRASE = "how can I reverse a python list"
ANSWER = b'{"choices": [{"message": {"content": "Use my_list.reverse() or my_list[::-1]."}}]}'


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    e = Embedder()
    yield e
    e.close()


def test_embeddings_are_unit_rows_and_computed_off_the_event_loop(embedder):
    vectors = embedder.embed([QUESTION, PARAPHRASE, "What is the capital of France?"])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert vectors[0] @ vectors[1] > 0.92 > vectors[0] @ vectors[2]

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        ticker = asyncio.create_task(tick())
        batch = await embedder.aembed([f"{QUESTION} Asked for the {i}th time, at length." for i in range(64)])
        ticker.cancel()
        assert np.allclose(batch[0], embedder.embed([f"{QUESTION} Asked for the 0th time, at length."])[0],
                           atol=1e-5)
        return ticks

    assert asyncio.run(main()) >= 5  # the loop kept running while the batch was embedded


def test_embeddings_equal_the_plain_model_s_mean_pooling(embedder):
    """The embedder's linears run oneDNN's packed product (layers/linear.py): its embeddings are the unpacked
    model's, pooled as sentence-transformers pools them, within float32 rounding (~1e-7 measured)."""
    import torch
    from transformers import AutoModel

    from llmserve.evaluate.datasets import MINILM, package_file
    from llmserve.layers.linear import PackedLinear

    texts = [QUESTION, "What is the capital of France?", "a long text " * 100]
    vectors = embedder.embed(texts)
    assert any(isinstance(m, PackedLinear) for m in embedder._model.modules())
    plain = AutoModel.from_pretrained(str(package_file(MINILM))).eval()
    batch = embedder._tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (plain(**batch).last_hidden_state * mask).sum(1) / mask.sum(1)
    np.testing.assert_allclose(vectors, torch.nn.functional.normalize(pooled, dim=-1).numpy(), atol=2e-6)


def test_a_paraphrase_hits_and_an_unrelated_question_misses(embedder):
    async def main() -> None:
        cache = SemanticCache(MemoryStore(), embedder)
        assert await cache.lookup("scope-a", QUESTION) is None
        await cache.put("scope-a", QUESTION, ANSWER)
        hit = await cache.lookup("scope-a", PARAPHRASE)
        assert hit is not None and hit.response == ANSWER and hit.query == QUESTION
        assert 0.92 <= hit.similarity <= 1.0001
        assert await cache.lookup("scope-a", "What is the capital of France?") is None
        assert await cache.lookup("scope-a", "How do I sort a dictionary by value in Python?") is None
        cache.close()

    asyncio.run(main())


def test_no_hit_crosses_scopes(embedder):
    async def main() -> None:
        cache = SemanticCache(MemoryStore(), embedder)
        await cache.put("scope-a", QUESTION, ANSWER)
        assert await cache.lookup("scope-b", QUESTION) is None
        assert await cache.lookup("scope-b", PARAPHRASE) is None
        assert (await cache.lookup("scope-a", QUESTION)).similarity == pytest.approx(1.0, abs=1e-4)
        cache.close()

    asyncio.run(main())


def test_expired_and_evicted_entries_miss(embedder):
    async def main() -> None:
        cache = SemanticCache(MemoryStore(), embedder, ttl=0.3)
        await cache.put("scope-a", QUESTION, ANSWER)
        assert await cache.lookup("scope-a", PARAPHRASE) is not None
        await asyncio.sleep(0.5)
        assert await cache.lookup("scope-a", PARAPHRASE) is None
        assert await SemanticCache(cache.store, embedder).lookup("scope-a", QUESTION) is None  # replay skips it

        small = SemanticCache(MemoryStore(max_entries=1), embedder, threshold=0.92)  # room for one answer
        await small.put("scope-a", QUESTION, ANSWER)
        await small.put("scope-b", "What is the capital of France?", b"Paris")
        assert await small.lookup("scope-a", PARAPHRASE) is None  # its answer was evicted
        assert not small._indexes["scope-a"].entries  # and its neighbour left the index
        assert (await small.lookup("scope-b", "Which city is the capital of France?")).response == b"Paris"
        cache.close()
        small.close()

    asyncio.run(main())


def test_two_gateways_over_one_store_see_each_others_entries(embedder):
    async def main() -> None:
        store = MemoryStore()
        first = SemanticCache(store, embedder, threshold=0.92)
        await first.put("scope-a", QUESTION, ANSWER)
        second = SemanticCache(store, embedder, threshold=0.92)  # built after the put: it replays the log
        hit = await second.lookup("scope-a", PARAPHRASE)
        assert hit is not None and hit.response == ANSWER
        await second.put("scope-a", "What is the capital of France?", b"Paris")
        assert (await first.lookup("scope-a", "Which city is the capital of France?")).response == b"Paris"
        first.close()
        second.close()

    asyncio.run(main())


class DownStore(MemoryStore):
    """A store whose backend is gone: every call fails as RedisStore's do."""

    async def get(self, key):
        raise StoreUnavailable("down")

    async def set(self, key, value, ttl):
        raise StoreUnavailable("down")

    async def append(self, log, value, max_len):
        raise StoreUnavailable("down")

    async def read_after(self, log, after, count):
        raise StoreUnavailable("down")


def test_store_failures_propagate_as_store_unavailable(embedder):
    async def main() -> None:
        for store in (DownStore(), RedisStore(f"redis://127.0.0.1:{free_port()}", timeout=0.2)):
            cache = SemanticCache(store, embedder)
            with pytest.raises(StoreUnavailable):
                await cache.lookup("scope-a", QUESTION)
            with pytest.raises(StoreUnavailable):
                await cache.put("scope-a", QUESTION, ANSWER)
            await store.close()
            cache.close()

    asyncio.run(main())


def test_two_gateways_share_an_entry_through_a_real_redis(embedder, redis_server):
    async def main() -> None:
        a, b = RedisStore(redis_server.url, prefix="test:"), RedisStore(redis_server.url, prefix="test:")
        first = SemanticCache(a, embedder)
        await first.put("scope-a", QUESTION, ANSWER)
        second = SemanticCache(b, embedder)
        hit = await second.lookup("scope-a", PARAPHRASE)
        assert hit is not None and hit.response == ANSWER and hit.query == QUESTION
        assert await second.lookup("scope-b", PARAPHRASE) is None
        for cache, store in ((first, a), (second, b)):
            cache.close()
            await store.close()

    asyncio.run(main())
