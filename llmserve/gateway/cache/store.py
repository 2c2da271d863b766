"""Where cached answers live: in this process (the default) or in Redis (shared by gateways, kept across
restarts). Both behind one small interface, so the caches never know which.

Two shapes of data: values with a TTL (`get`/`set`), and an append-only log (`append`/`read_after`) that
lets every gateway replay the semantic entries any gateway wrote, to build its own nearest-neighbour index.

A Redis that goes away must not cost a request: every Redis call has short timeouts, and its failures raise
`StoreUnavailable`, which the caches count and treat as a miss. After a failure the store rests for
`retry_after` seconds instead of paying a timeout on every request.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Protocol

logger = logging.getLogger(__name__)


class StoreUnavailable(Exception):
    """The store could not be reached; the cache is bypassed for this request."""


class CacheStore(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl: float) -> None: ...

    async def append(self, log: str, value: bytes, max_len: int) -> None: ...

    async def read_after(self, log: str, after: str, count: int) -> list[tuple[str, bytes]]:
        """Log entries after the id `after` ("0" from the start), oldest first, at most `count`."""
        ...

    async def close(self) -> None: ...


class MemoryStore:
    """One process's store: a dict with expiry times (bounded, oldest evicted first) and in-memory logs."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._values: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._logs: dict[str, list[bytes]] = {}
        self._dropped: dict[str, int] = {}  # per log, how many of its oldest entries were trimmed

    async def get(self, key: str) -> bytes | None:
        item = self._values.get(key)
        if item is None:
            return None
        if item[0] < time.monotonic():
            del self._values[key]
            return None
        self._values.move_to_end(key)
        return item[1]

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        self._values[key] = (time.monotonic() + ttl, value)
        self._values.move_to_end(key)
        while len(self._values) > self.max_entries:
            self._values.popitem(last=False)

    async def append(self, log: str, value: bytes, max_len: int) -> None:
        entries = self._logs.setdefault(log, [])
        entries.append(value)
        if len(entries) > max_len:  # ids stay stable: the n-th entry ever appended has id n
            cut = len(entries) - max_len
            del entries[:cut]
            self._dropped[log] = self._dropped.get(log, 0) + cut

    async def read_after(self, log: str, after: str, count: int) -> list[tuple[str, bytes]]:
        entries, dropped = self._logs.get(log, []), self._dropped.get(log, 0)
        start = max(int(after) - dropped, 0)
        return [(str(dropped + i + 1), v) for i, v in enumerate(entries[start:start + count], start)]

    async def close(self) -> None:
        return None


class RedisStore:
    """Redis as the shared store: values as plain keys with an expiry, logs as Redis streams (XADD/XRANGE,
    trimmed to about `max_len` entries). Every key starts with `prefix`."""

    def __init__(self, url: str, prefix: str = "llmserve:gw:", timeout: float = 0.5, retry_after: float = 2.0) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.prefix = prefix
        self.retry_after = retry_after
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                               retry_on_timeout=False)
        self._down_until = 0.0

    async def get(self, key: str) -> bytes | None:
        return await self._call(self._client.get, self.prefix + key)

    async def set(self, key: str, value: bytes, ttl: float) -> None:
        await self._call(self._client.set, self.prefix + key, value, px=max(1, int(ttl * 1000)))

    async def append(self, log: str, value: bytes, max_len: int) -> None:
        await self._call(self._client.xadd, self.prefix + log, {b"v": value}, maxlen=max_len, approximate=True)

    async def read_after(self, log: str, after: str, count: int) -> list[tuple[str, bytes]]:
        start = "-" if after == "0" else "(" + after  # "(" : exclusive of `after`
        rows = await self._call(self._client.xrange, self.prefix + log, start, "+", count)
        return [(entry_id.decode(), fields[b"v"]) for entry_id, fields in rows]

    async def ping(self) -> bool:
        try:
            return bool(await self._call(self._client.ping))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, fn, *args, **kwargs):
        import redis.exceptions

        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"redis at {self.url} is resting after a failure")
        try:
            return await fn(*args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            self._down_until = time.monotonic() + self.retry_after
            logger.warning("redis at %s unavailable (%s); cache bypassed for %.0f s", self.url, e, self.retry_after)
            raise StoreUnavailable(str(e)) from e


def open_store(redis_url: str | None, max_entries: int = 100_000) -> CacheStore:
    """Redis when a URL is given, else the in-process store."""
    return RedisStore(redis_url) if redis_url else MemoryStore(max_entries)
