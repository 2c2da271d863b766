"""The semantic cache: a request whose last user message means the same as a cached one's (cosine of their
MiniLM embeddings >= `threshold`), inside the same exactly-matched scope, gets the cached answer.

Where things live. Each answer is a store value with a TTL; each `put` also appends a record (scope, query
text, embedding, entry key, wall-clock expiry) to the store's log. The nearest-neighbour indexes are NOT in
the store: every gateway keeps its own in this process, one per scope (a hit can never cross scopes), and
before each lookup replays the log records it has not seen. So gateways sharing one Redis see each other's
entries, and a restarted gateway rebuilds its indexes from Redis. An expired record is skipped; a neighbour
whose answer has expired or been evicted is a miss, and is deleted from its index.

Which index: hnswlib (HNSW, inner product on unit vectors = cosine; M=16, ef_construction=64, ef_search=128),
chosen against faiss's HNSW, usearch and exact search (one query, k=1,
entries shaped like MiniLM's, recall@1 of paraphrase-like queries against exact search;
docs/performance.md, "The gateway"). Exact search grows too slow at 100k entries; hnswlib and faiss are within
noise of each other, and hnswlib also deletes (`mark_deleted`) and reuses the slots of expired entries, which
faiss's HNSW cannot. A restart's replay pays the index build, off the loop. ef 128 rather than 32: it keeps recall
near exact search's for little beside the real cost of a lookup, MiniLM embedding the query (far more when other
processes contend for the cores). So a scope with no entries answers "miss" without embedding anything, and a
miss's embedding is kept for its `put`.

Index operations all run in one worker thread of this cache (hnswlib's search is not safe beside an insert),
so neither a search nor a big catch-up after a restart blocks the event loop. Store failures propagate as
`StoreUnavailable`: the caller counts them and bypasses the cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import orjson

from llmserve.gateway.cache.store import CacheStore

logger = logging.getLogger(__name__)

M, EF_CONSTRUCTION, EF_SEARCH = 16, 64, 128
CANDIDATES = 4  # neighbours looked at: the nearest may have expired while the next one still answers
PURGE_EVERY = 60.0  # seconds between sweeps that delete expired entries (and empty scopes) from the indexes


class TextEmbedder(Protocol):
    async def aembed(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class SemanticHit:
    response: bytes
    similarity: float  # cosine of the two queries' embeddings
    query: str  # the cached query that matched


@dataclass
class _Entry:
    key: str
    query: str
    expires: float  # wall clock (time.time()), so that every gateway reads it alike


class _ScopeIndex:
    """One scope's HNSW graph; labels are this index's own ints, entries map them back to store keys."""

    def __init__(self, dim: int) -> None:
        import hnswlib

        self.dim = dim
        self.index = hnswlib.Index(space="ip", dim=dim)
        self.index.init_index(max_elements=16, ef_construction=EF_CONSTRUCTION, M=M, allow_replace_deleted=True)
        self.index.set_ef(EF_SEARCH)
        self.index.set_num_threads(1)  # modest: the gateway's cores serve requests and embed queries
        self.entries: dict[int, _Entry] = {}
        self.labels: dict[str, int] = {}  # entry key -> label
        self.next_label = 0

    def add(self, records: list[tuple[_Entry, np.ndarray]]) -> None:
        fresh: dict[str, tuple[_Entry, np.ndarray]] = {}
        for entry, vector in records:
            label = self.labels.get(entry.key)
            if vector.shape != (self.dim,):
                logger.warning("skipping a semantic-cache entry of %d dims in an index of %d", vector.size, self.dim)
            elif label is not None:  # the same query put again: its answer was overwritten, its expiry moves
                self.entries[label].expires = max(self.entries[label].expires, entry.expires)
            else:
                fresh[entry.key] = (entry, vector)
        if not fresh:
            return
        needed = self.index.get_current_count() + len(fresh)
        if needed > self.index.get_max_elements():
            self.index.resize_index(max(needed, 2 * self.index.get_max_elements()))
        labels = np.arange(self.next_label, self.next_label + len(fresh))
        self.next_label += len(fresh)
        self.index.add_items(np.stack([v for _, v in fresh.values()]), labels, replace_deleted=True)
        for label, (entry, _) in zip(labels.tolist(), fresh.values(), strict=True):
            self.entries[label], self.labels[entry.key] = entry, label

    def search(self, vector: np.ndarray, threshold: float) -> list[tuple[int, float]]:
        """Up to CANDIDATES (label, cosine) at or above `threshold`, nearest first."""
        k = min(CANDIDATES, len(self.entries))
        if k == 0:
            return []
        try:
            labels, distances = self.index.knn_query(vector, k=k)
        except RuntimeError:  # fewer than k found (possible once entries are deleted): a miss, not an error
            return []
        return [(int(lb), 1.0 - float(d)) for lb, d in zip(labels[0], distances[0], strict=True)
                if 1.0 - d >= threshold]

    def drop(self, label: int) -> None:
        entry = self.entries.pop(label, None)
        if entry is not None:
            del self.labels[entry.key]
            self.index.mark_deleted(label)

    def purge(self, now: float) -> None:
        for label in [lb for lb, e in self.entries.items() if e.expires <= now]:
            self.drop(label)


class SemanticCache:
    """Answers by meaning, within a scope. `lookup` then, on a miss, `put` once the upstream has answered."""

    def __init__(self, store: CacheStore, embedder: TextEmbedder, threshold: float = 0.97, ttl: float = 3600.0,
                 log: str = "semantic", max_log: int = 1_000_000, catch_up_per_lookup: int = 1024) -> None:
        self.store, self.embedder = store, embedder
        self.threshold, self.ttl, self.log, self.max_log = threshold, ttl, log, max_log
        self.catch_up_per_lookup = catch_up_per_lookup  # a restart's backlog is replayed this much per lookup
        self._indexes: dict[str, _ScopeIndex] = {}
        self._last_id = "0"
        self._catching_up = False
        self._purged = time.time()
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()  # a miss's embedding, reused by its put
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-semantic-index")

    async def lookup(self, scope: str, query: str) -> SemanticHit | None:
        await self._catch_up(self.catch_up_per_lookup)
        index = self._indexes.get(scope)
        if index is None or not index.entries:
            return None  # nothing to compare with: no embedding paid
        vector = await self._embed(query)
        for label, similarity in await self._in_thread(index.search, vector, self.threshold):
            entry = index.entries.get(label)
            if entry is None:
                continue
            response = await self.store.get(entry.key) if entry.expires > time.time() else None
            if response is not None:
                return SemanticHit(response=response, similarity=similarity, query=entry.query)
            await self._in_thread(index.drop, label)
        return None

    async def put(self, scope: str, query: str, response: bytes) -> None:
        vector = await self._embed(query)
        key = "sem:" + hashlib.sha256(f"{scope}\n{query}".encode()).hexdigest()
        await self.store.set(key, response, self.ttl)
        header = orjson.dumps({"s": scope, "q": query, "k": key, "x": time.time() + self.ttl})
        await self.store.append(self.log, header + b"\n" + vector.astype("<f4").tobytes(), self.max_log)

    async def sync(self) -> None:
        """Replay the whole log now (a gateway's start-up, in the background), not a batch per lookup."""
        while self._catching_up:
            await asyncio.sleep(0.01)
        await self._catch_up(None)

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    async def _catch_up(self, limit: int | None) -> None:
        if self._catching_up:
            return  # another task is replaying: search what is indexed so far rather than wait
        self._catching_up = True
        try:
            done, batch = 0, 256
            while limit is None or done < limit:
                rows = await self.store.read_after(self.log, self._last_id, batch)
                if rows:
                    await self._in_thread(self._index, [_parse(value) for _, value in rows])
                    self._last_id, done = rows[-1][0], done + len(rows)
                if len(rows) < batch:
                    break
            if time.time() - self._purged > PURGE_EVERY:
                self._purged = time.time()
                await self._in_thread(self._purge)
        finally:
            self._catching_up = False

    def _index(self, records: list[tuple[str, _Entry, np.ndarray] | None]) -> None:
        now, by_scope = time.time(), {}
        for record in records:
            if record is not None and record[1].expires > now:
                by_scope.setdefault(record[0], []).append(record[1:])
        for scope, entries in by_scope.items():
            if scope not in self._indexes:
                self._indexes[scope] = _ScopeIndex(len(entries[0][1]))
            self._indexes[scope].add(entries)

    def _purge(self) -> None:
        now = time.time()
        for scope, index in list(self._indexes.items()):
            index.purge(now)
            if not index.entries:
                del self._indexes[scope]

    async def _embed(self, query: str) -> np.ndarray:
        vector = self._vectors.get(query)
        if vector is None:
            vector = np.ascontiguousarray((await self.embedder.aembed([query]))[0], dtype=np.float32)
            self._vectors[query] = vector
            while len(self._vectors) > 256:
                self._vectors.popitem(last=False)
        self._vectors.move_to_end(query)
        return vector

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)


def _parse(value: bytes) -> tuple[str, _Entry, np.ndarray] | None:
    """A log record: a JSON header line, then the embedding as little-endian float32. None: unreadable."""
    try:
        header, _, raw = value.partition(b"\n")
        fields = orjson.loads(header)
        vector = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        if vector.size == 0:
            raise ValueError("no embedding")
        return fields["s"], _Entry(key=fields["k"], query=fields["q"], expires=float(fields["x"])), vector
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("skipping an unreadable semantic-cache log record (%s)", e)
        return None
