"""The replicas behind each model, and what the gateway believes about their health.

A replica takes traffic only while it is *ready* (its last active `/health` probe answered 200) and not
*ejected*. Passive health: `eject_after` consecutive failures (connection errors, timeouts, 5xx) eject it
for `eject_seconds`; after that one trial request is let through (half-open): success puts it back,
failure ejects it again for twice as long (up to a minute). A success resets the count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from llmserve.gateway.config import GatewayConfig, HealthConfig, ModelRoute

logger = logging.getLogger(__name__)

MAX_EJECTION_S = 60.0
CARD_TTL_S = 60.0  # how long a replica's /v1/models answer is reused for the gateway's own


@dataclass
class Replica:
    url: str
    model: str
    api_key: str | None = None
    ready: bool = True  # the last probe's verdict (replicas are probed once before the gateway serves)
    outstanding: int = 0  # requests sent and not yet finished
    failures: int = 0  # consecutive
    ejected_until: float = 0.0
    ejection_s: float = 0.0
    trial_in_flight: bool = False  # half-open: one request decides
    ejections: int = 0
    health_path: str = "/health"

    def available(self, now: float) -> bool:
        if not self.ready:
            return False
        if now < self.ejected_until:
            return False
        return not (self.ejection_s and self.trial_in_flight)  # half-open: one trial at a time

    def started(self, now: float) -> None:
        self.outstanding += 1
        if self.ejection_s and now >= self.ejected_until:
            self.trial_in_flight = True

    def succeeded(self) -> None:
        self.failures = 0
        if self.ejection_s:
            logger.info("replica %s recovered", self.url)
        self.ejection_s = 0.0
        self.trial_in_flight = False

    def failed(self, health: HealthConfig, why: str) -> bool:
        """Count a failure; True when it ejects the replica."""
        self.failures += 1
        half_open = self.ejection_s > 0
        self.trial_in_flight = False
        if not half_open and self.failures < health.eject_after:
            return False
        self.ejection_s = min(self.ejection_s * 2, MAX_EJECTION_S) if half_open else health.eject_seconds
        self.ejected_until = time.monotonic() + self.ejection_s
        self.ejections += 1
        logger.warning("replica %s ejected for %.0f s after %d failure(s): %s", self.url, self.ejection_s,
                       self.failures, why)
        return True

    def finished(self) -> None:
        self.outstanding -= 1


class UpstreamPool:
    """Every model's replicas, one HTTP session for all of them, and the active health prober."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.replicas: dict[str, list[Replica]] = {
            name: [Replica(url=url, model=name, api_key=route.api_key, health_path=route.health_path)
                   for url in route.upstreams]
            for name, route in config.models.items()
        }
        self.session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        self._cards: dict[str, tuple[float, dict[str, Any]]] = {}  # model -> (read at, its replica's fields)

    def route(self, model: str) -> ModelRoute | None:
        return self.config.models.get(model)

    def available(self, model: str) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas.get(model, ()) if r.available(now)]

    def all(self) -> list[Replica]:
        return [r for replicas in self.replicas.values() for r in replicas]

    async def start(self) -> None:
        # no connection cap per host: the gateway is only a pass-through, the replicas do the queueing
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout,
                                        sock_read=self.config.read_timeout)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)
        await self.probe_all()
        self._prober = asyncio.create_task(self._probe_forever())

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        if self.session is not None:
            await self.session.close()

    async def model_card(self, model: str) -> dict[str, Any]:
        """What a replica of `model` says of it in its /v1/models (its `root`, `max_model_len`, ...), read once a
        minute; {} where no replica answers."""
        cached = self._cards.get(model)
        if cached is not None and time.monotonic() - cached[0] < CARD_TTL_S:
            return cached[1]
        replicas, card = self.available(model), {}
        if replicas:
            replica = replicas[0]
            try:
                async with self.session.get(replica.url + "/v1/models", headers=auth_headers(replica),
                                            timeout=aiohttp.ClientTimeout(total=self.config.health.timeout)) as r:
                    listed = (await r.json(content_type=None)).get("data") if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
                listed = None
            cards = [c for c in listed or () if isinstance(c, dict)]
            wanted = self.config.models[model].upstream_model or model
            found = next((c for c in cards if c.get("id") == wanted), cards[0] if cards else {})
            card = {k: v for k, v in found.items() if k not in ("id", "object", "created", "owned_by")}
        self._cards[model] = (time.monotonic(), card)
        return card

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in self.all()))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health.interval)
            await self.probe_all()

    async def _probe(self, replica: Replica) -> None:
        assert self.session is not None
        try:
            async with self.session.get(replica.url + replica.health_path, headers=auth_headers(replica),
                                        timeout=aiohttp.ClientTimeout(total=self.config.health.timeout)) as r:
                ready = r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            ready = False
        if ready != replica.ready:
            logger.warning("replica %s of %s is %s", replica.url, replica.model, "ready" if ready else "NOT ready")
        replica.ready = ready


def auth_headers(replica: Replica) -> dict[str, str]:
    return {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
