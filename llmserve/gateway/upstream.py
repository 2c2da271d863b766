"""The replicas behind each model, and what the gateway believes about their health.

A replica takes traffic while it is *ready* and not *ejected*. Active health: a probe of its `/health` that
answers anything but 200 (loading, draining) marks it not ready at once, since that is the replica's own word;
probes that time out or cannot connect mark it not ready only after `down_after` in a row, since a replica
busy with a full batch may answer its probe late while serving well, and a request it answers counts as a
probe that passed. Passive health: `eject_after` consecutive failures (connection errors, timeouts, 5xx) eject
it for `eject_seconds`; after that one trial request is let through (half-open): success puts it back, failure
ejects it again for twice as long (up to a minute). A success resets the count.

When no replica of a model is available, requests go to the least bad one rather than being refused (the
shortest ejection left, then the fewest failures): the gateway's view of health may be stale, and a replica that
is really gone fails fast and the request is retried on the next.

A disaggregated model's prefill and decode replicas are pools of their own, keyed by `role_pool` ("m/prefill",
"m/decode"; its `upstreams` stay under "m"), so the prober, the metrics and the dashboard cover them like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from llmserve.gateway.config import GatewayConfig, HealthConfig, ModelRoute, role_pool

logger = logging.getLogger(__name__)

MAX_EJECTION_S = 60.0
CARD_TTL_S = 60.0  # how long a replica's /v1/models answer is reused for the gateway's own


@dataclass
class Replica:
    url: str
    model: str
    api_key: str | None = None
    ready: bool = True  # the probes' verdict (replicas are probed once before the gateway serves)
    probe_failures: int = 0  # consecutive probes that timed out or could not connect
    answered_probe: bool = False  # a replica never seen healthy is marked down by its first failed probe
    said_not_ready: bool = False  # its last probe answered non-200: only a probe's 200 brings it back
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
        """A request it answered: as good as a probe that passed."""
        self.failures = 0
        self.probe_failures = 0
        self.ready = self.ready or not self.said_not_ready
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

    def probed(self, status: int | None, health: HealthConfig) -> None:
        """A probe's answer: its HTTP status, or None when it timed out or could not connect."""
        self.said_not_ready = status is not None and status != 200
        if status == 200:
            self.ready, self.probe_failures, self.answered_probe = True, 0, True
            return
        if self.said_not_ready:
            self.ready = False  # the replica's own word (loading, draining)
            return
        self.probe_failures += 1
        if self.probe_failures >= health.down_after or not self.answered_probe:
            self.ready = False

    def badness(self, now: float) -> tuple[float, int, int]:
        """For the fallback when none is available: still ejected for how long, then failures, then load."""
        return max(0.0, self.ejected_until - now), self.failures + self.probe_failures, self.outstanding


class UpstreamPool:
    """Every model's replicas, one HTTP session for all of them, and the active health prober."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        # pool name (a model's, or a role_pool) -> its replicas
        self.replicas: dict[str, list[Replica]] = {}
        for name, route in config.models.items():
            for pool, urls in ((name, route.upstreams), (role_pool(name, "prefill"), route.prefill),
                               (role_pool(name, "decode"), route.decode)):
                if urls or pool == name:
                    self.replicas[pool] = [Replica(url=url, model=pool, api_key=route.api_key,
                                                   health_path=route.health_path) for url in urls]
        self.session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        self._cards: dict[str, tuple[float, dict[str, Any]]] = {}  # model -> (read at, its replica's fields)

    def route(self, model: str) -> ModelRoute | None:
        return self.config.models.get(model)

    def available(self, pool: str) -> list[Replica]:
        """`pool`: a model's name, or a role_pool."""
        now = time.monotonic()
        return [r for r in self.replicas.get(pool, ()) if r.available(now)]

    def candidates(self, pool: str) -> list[Replica]:
        """Where a request may go: the available replicas, else every replica, least bad first (a request is
        tried rather than refused because the gateway's view of health may be stale)."""
        available = self.available(pool)
        if available:
            return available
        now = time.monotonic()
        return sorted(self.replicas.get(pool, ()), key=lambda r: r.badness(now))

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
        # a disaggregated model may have no `upstreams`: its decode instances serve the same model
        replicas, card = self.available(model) or self.available(role_pool(model, "decode")), {}
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
                status: int | None = r.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            status = None
        was = replica.ready
        replica.probed(status, self.config.health)
        if replica.ready != was:
            logger.warning("replica %s of %s is %s (probe: %s)", replica.url, replica.model,
                           "ready" if replica.ready else "NOT ready",
                           status if status is not None else f"{replica.probe_failures} without an answer")


def auth_headers(replica: Replica) -> dict[str, str]:
    return {"Authorization": f"Bearer {replica.api_key}"} if replica.api_key else {}
