from __future__ import annotations

import asyncio
import time

import pytest

from llmserve.gateway.cache.store import MemoryStore, RedisStore, StoreUnavailable


def test_memory_store_expiry_bound_and_log():
    async def run() -> None:
        store = MemoryStore(max_entries=2)
        await store.set("a", b"1", ttl=0.05)
        await store.set("b", b"2", ttl=60)
        assert await store.get("a") == b"1"
        await asyncio.sleep(0.06)
        assert await store.get("a") is None
        await store.set("c", b"3", ttl=60)
        await store.set("d", b"4", ttl=60)
        assert await store.get("b") is None and await store.get("d") == b"4"  # oldest evicted past the bound
        for i in range(5):
            await store.append("log", str(i).encode(), max_len=3)
        rows = await store.read_after("log", "0", 10)
        assert [v for _, v in rows] == [b"2", b"3", b"4"]  # trimmed to the newest 3, ids stable
        assert [v for _, v in await store.read_after("log", rows[0][0], 10)] == [b"3", b"4"]

    asyncio.run(run())


def test_redis_store_shares_and_fails_soft(redis_server):
    async def run() -> None:
        a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
        await a.set("k", b"v", ttl=60)
        assert await b.get("k") == b"v"
        await a.append("log", b"x", max_len=100)
        await a.append("log", b"y", max_len=100)
        rows = await b.read_after("log", "0", 10)
        assert [v for _, v in rows] == [b"x", b"y"]
        assert [v for _, v in await b.read_after("log", rows[0][0], 10)] == [b"y"]
        await a.close()
        redis_server.stop()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await b.get("k")
        with pytest.raises(StoreUnavailable):  # resting: fails at once, no timeout paid again
            await b.get("k")
        assert time.monotonic() - started < 2.0
        assert not await b.ping()
        await b.close()

    asyncio.run(run())
