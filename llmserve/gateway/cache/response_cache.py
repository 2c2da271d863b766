"""The cache link of the gateway's chain: which requests may be served from cache or stored, the exact
lookup, then the semantic one, and what to do when the store fails (count it, serve from upstream).

Per request, `Cache-Control: no-cache` skips the lookup (the answer is still stored: a refresh) and
`no-store` skips both. By default only deterministic requests (temperature 0, or a seed) are cached:
replaying one sample of a random answer would silently change what users get. A semantic hit must also
pass the lexical guard (`guard.py`: same numbers, negations and names).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmserve.gateway.cache.guard import compatible
from llmserve.gateway.cache.keys import CacheKeys, cache_keys, is_deterministic
from llmserve.gateway.cache.store import CacheStore, StoreUnavailable
from llmserve.gateway.config import CacheConfig
from llmserve.gateway.metrics import GatewayMetrics

if TYPE_CHECKING:  # the semantic cache pulls in torch and hnswlib: only where it is switched on
    from llmserve.gateway.cache.semantic import SemanticCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachePlan:
    """What the cache may do for one request."""

    keys: CacheKeys
    read: bool
    write: bool


@dataclass(frozen=True)
class CacheHit:
    kind: str  # "exact" or "semantic"
    answer: bytes  # the cached non-streaming response body (JSON)
    similarity: float = 1.0


class ResponseCache:
    def __init__(self, config: CacheConfig, store: CacheStore, metrics: GatewayMetrics,
                 semantic: SemanticCache | None = None) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.semantic = semantic  # a SemanticCache, or None when semantic caching is off

    def plan(self, namespace: str, route: str, body: dict[str, Any], cache_control: str) -> CachePlan | None:
        """None when the cache has nothing to do with this request."""
        if not (self.config.exact or self.semantic is not None):
            return None
        if self.config.deterministic_only and route != "embeddings" and not is_deterministic(body):
            return None
        directives = {d.strip().lower() for d in cache_control.split(",")}
        if "no-store" in directives:
            return None
        return CachePlan(cache_keys(namespace, route, body), read="no-cache" not in directives, write=True)

    async def lookup(self, plan: CachePlan) -> CacheHit | None:
        if not plan.read:
            return None
        try:
            if self.config.exact:
                answer = await self.store.get("exact:" + plan.keys.exact)
                if answer is not None:
                    self.metrics.cache_lookups.labels("exact").inc()
                    return CacheHit("exact", answer)
            if self.semantic is not None and plan.keys.query is not None:
                hit = await self.semantic.lookup(plan.keys.scope, plan.keys.query)
                if hit is not None and compatible(hit.query, plan.keys.query):
                    self.metrics.cache_lookups.labels("semantic").inc()
                    return CacheHit("semantic", hit.response, hit.similarity)
                if hit is not None:  # close in meaning, but another number, negation or name
                    self.metrics.guard_rejections.inc()
        except StoreUnavailable:
            self.metrics.cache_errors.labels("lookup").inc()
            return None
        self.metrics.cache_lookups.labels("miss").inc()
        return None

    async def put(self, plan: CachePlan, answer: bytes) -> None:
        if not plan.write:
            return
        try:
            if self.config.exact:
                await self.store.set("exact:" + plan.keys.exact, answer, self.config.ttl)
            if self.semantic is not None and plan.keys.query is not None:
                await self.semantic.put(plan.keys.scope, plan.keys.query, answer)
        except StoreUnavailable:
            self.metrics.cache_errors.labels("store").inc()
