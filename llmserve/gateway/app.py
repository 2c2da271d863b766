"""The gateway's FastAPI app: one chain per request, each link a small object.

    key and limits ─▶ route ─▶ cache (exact, then semantic) ─▶ compress ─▶ balance (a replica) ─▶ upstream ─▶ store

Responses API calls (`/v1/responses`) take the same chain without cache or compression; a continuation
(`previous_response_id`) goes to the replica that stored the response it continues, for the key that made it.

A failure before the client's first byte (connection refused, timeout, 5xx, a stream that dies before its
first event) is retried on another replica, at most `retries` times; after the first byte it cannot be, and
the stream ends with an error event. A client that goes away closes the upstream connection, which aborts
the upstream request.

A model with `prefill` and `decode` replicas (disaggregation) sends a chat or completion in two hops: a prefill
hop (max_tokens 1) computes the prompt's KV on a prefill instance, then the request itself goes to a decode
instance told where that KV is (`kv_transfer_params`, vLLM's names). A hop that fails on every replica falls
back to the plain request on the model's `upstreams` (else, after a failed prefill, on its decode instances,
which compute the prompt themselves): a failure costs time, never the answer.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from llmserve import __version__
from llmserve.embeddings import Embedder
from llmserve.gateway import dashboard
from llmserve.gateway.admin import AdminGate
from llmserve.gateway.balancing import make_balancer, prefix_chunks
from llmserve.gateway.cache.response_cache import CachePlan, ResponseCache
from llmserve.gateway.cache.store import CacheStore, StoreUnavailable, open_store
from llmserve.gateway.compression import HEADER as COMPRESSION_HEADER
from llmserve.gateway.compression import Compression, Compressor
from llmserve.gateway.config import APIKey, GatewayConfig, ModelRoute, role_pool
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.ratelimit import RateLimiter
from llmserve.gateway.response_homes import ResponseHomes
from llmserve.gateway.responses import StreamAssembler, fresh_identity, replay_events, replayable
from llmserve.gateway.routing import build_router
from llmserve.gateway.routing.judge import Ask
from llmserve.gateway.routing.router import RouteDecision
from llmserve.gateway.upstream import Replica, UpstreamPool, auth_headers
from llmserve.server.errors import APIError, install_handlers
from llmserve.server.middleware import RequestBodyMiddleware
from llmserve.server.sse import SSE_DONE, SSEResponse, unless_disconnected

if TYPE_CHECKING:
    from llmserve.gateway.cache.semantic import SemanticCache

logger = logging.getLogger(__name__)

CACHE_HEADER = "x-llmserve-cache"
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings",
          "responses": "/v1/responses"}
_UNCOMPRESSED = ("embeddings", "responses")  # compression rewrites chat messages and completion prompts only
_RESPONSE_FINAL = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")
ROUTE_HEADER = "x-llmserve-route"  # the model a routed name chose; x-llmserve-route-reason says why
COST_HEADER = "x-llmserve-cost-usd"  # also usage.cost (OpenRouter's field); a stream has it in its usage chunk only
SAVED_HEADER = "x-llmserve-saved-usd"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPEN_NAMESPACE = APIKey(key="", namespace="default")
_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')  # the usage chunk, compact or not
_RETRYABLE_UPSTREAM = frozenset({429, 500, 502, 503, 504})  # another replica may well answer
DISAGGREGATION_HEADER = "x-llmserve-disaggregation"  # "prefill=URL; decode=URL" or "fallback=URL; reason=..."
_DISAGGREGATED = ("chat", "completions")  # the routes a prefill/decode model sends in two hops
_FALLBACK_REASONS = {"fallback_prefill_failed": "prefill failed", "fallback_decode_failed": "decode failed"}


class _UpstreamFailed(Exception):
    """This replica failed before the client got a byte: try another."""

    def __init__(self, why: str, status: int | None = None, body: bytes | None = None) -> None:
        super().__init__(why)
        self.status, self.body = status, body


class _Exhausted(Exception):
    """Every replica of a pool that was tried failed; `last`: the last failure (None: none could be tried)."""

    def __init__(self, last: _UpstreamFailed | None) -> None:
        super().__init__(str(last))
        self.last = last


@dataclass(frozen=True)
class _Leg:
    """One place a request may go: a pool of replicas and the body they get; for a disaggregated model's chat or
    completion, the outcome it counts (disaggregated_requests_total) and the prefill replica that holds the KV."""

    pool: str  # a key of UpstreamPool.replicas
    payload: dict[str, Any]
    outcome: str | None = None
    prefill_url: str | None = None

    def header(self, url: str) -> str | None:
        """x-llmserve-disaggregation for an answer from `url`."""
        if self.outcome is None:
            return None
        if self.prefill_url is not None:
            return f"prefill={self.prefill_url}; decode={url}"
        return f"fallback={url}; reason={_FALLBACK_REASONS[self.outcome]}"


@dataclass
class _Call:
    """One request on its way upstream."""

    route: str  # a key of _PATHS
    model: str
    key: APIKey
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    plan: CachePlan | None
    decision: RouteDecision | None = None  # a routed name's choice (`model` is the chosen one)
    compression: Compression | None = None
    home: str | None = None  # the only replica that may answer (a Responses continuation's)
    disaggregation: str | None = None  # what the last _send did, for x-llmserve-disaggregation


@dataclass
class _Lease:
    """A replica's outstanding slot and its open answer, given back exactly once however the request ends:
    answered, failed, or its client gone before the first byte or after it."""

    replica: Replica
    response: aiohttp.ClientResponse
    released: bool = False

    def release(self, clean: bool = False) -> None:
        if self.released:
            return
        self.released = True
        if clean:
            self.response.release()  # read to the end: the connection goes back to the pool
        else:
            self.response.close()  # aborts the upstream request
        self.replica.finished()


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pool = UpstreamPool(config)
        self.metrics = GatewayMetrics(self.pool.all)
        self.balancers = {name: make_balancer(route.balancing, config.prefix_balance_slack)
                          for name, route in config.models.items()}
        self.limiter = RateLimiter()
        self.keys = config.key_table()
        self.store = open_store(config.cache.redis_url)
        # one MiniLM for the semantic cache and the learned routers; loaded on first use
        self.embedder = Embedder()
        semantic = _semantic_cache(config, self.store, self.embedder) if config.cache.semantic else None
        self.cache = ResponseCache(config.cache, self.store, self.metrics, semantic)
        self.routers = {name: build_router(router, self._judge(router.judge_model or router.weak), self.embedder)
                        for name, router in config.routers.items()}
        self.compressor = Compressor(self._asker("completions", "compressor"), tuple(config.models))
        self.homes = ResponseHomes()
        self._sync: asyncio.Task | None = None

    async def start(self) -> None:
        await self.pool.start()
        if self.cache.semantic is not None or any(r.config.router == "learned" for r in self.routers.values()):
            await self.embedder.aembed(["warm-up"])  # MiniLM loads now (seconds), not inside the first request
        if self.cache.semantic is not None:
            # the indexes are rebuilt from a shared store in the background, without holding requests
            self._sync = asyncio.create_task(self._sync_semantic())

    async def _sync_semantic(self) -> None:
        try:
            await self.cache.semantic.sync()
        except StoreUnavailable:
            logger.warning("semantic cache: the store is unavailable; its index fills as requests come")

    async def close(self) -> None:
        await self.pool.close()
        if self.cache.semantic is not None:
            self.cache.semantic.close()
        self.embedder.close()
        await self.store.close()

    # --- the chain -----------------------------------------------------------------------------

    async def handle(self, route: str, request: Request) -> Response:
        """The chain for one request; every answer, refusals included, is counted by model and status."""
        try:
            return await self._handle(route, request)
        except APIError as e:
            self.metrics.requests.labels(getattr(request.state, "model", "-"), str(e.status)).inc()
            raise

    async def _handle(self, route: str, request: Request) -> Response:
        key = self._authenticate(request)
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "model: required, a string", param="model")
        known = self.pool.route(model) is not None or model in self.routers
        request.state.model = model if known else "-"  # no label per unknown name
        if not known:
            names = [*self.config.models, *self.routers]
            raise APIError(404, f"the model {model!r} does not exist; known: {', '.join(names)}",
                           param="model", code="model_not_found")
        if route in _UNCOMPRESSED and model in self.routers:
            raise APIError(400, f"{model!r} routes chat and completions by their difficulty; ask a model by its own "
                           f"name for {_PATHS[route]}", param="model")
        home = self._home(key, body) if route == "responses" else None
        refusal = self.limiter.admit(key)
        if refusal is not None:
            self.metrics.rate_limited.labels(key.namespace, refusal.limit).inc()
            raise APIError(429, refusal.message, code="rate_limit_exceeded",
                           headers={"Retry-After": str(refusal.retry_after)})
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        decision = None
        if model in self.routers:  # routed first: a cached answer is the chosen model's, priced as its own
            decision = await self._route(model, route, body)
            model = decision.model
            body = {**body, "model": model}
        # a Responses answer is never replayed: its id is one a later call continues, on the replica that stored it
        plan = self.cache.plan(key.namespace, route, body, request.headers.get("cache-control", "")) \
            if route != "responses" else None
        call = _Call(route, model, key, body, stream, include_usage, plan, decision, home=home)
        if plan is not None:
            hit = await self.cache.lookup(plan)
            if hit is not None:
                return self._from_cache(call, hit.kind, hit.answer)
        # after the cache: a hit costs no scorer call, and the key is the request as sent (`compress` included: another
        # rate is another prompt); before the upstream, which never sees the `compress` field
        call.compression = await self.compressor.apply(route, body, self.config.models[model].compress) \
            if route not in _UNCOMPRESSED else Compression(body)
        call.body = call.compression.body
        if call.compression.outcome is not None:
            self.metrics.compressions.labels(model, call.compression.outcome).inc()
        if stream:
            return await self._stream(call, request)
        return await unless_disconnected(request, self._complete(call))

    async def _route(self, name: str, route: str, body: dict[str, Any]) -> RouteDecision:
        try:
            decision = await self.routers[name].decide(route, body)
        except APIError as e:
            logger.warning("router %s: the judge failed (%s); sending the request to the strong model", name, e)
            decision = self.routers[name].fallback()
        self.metrics.routed.labels(name, decision.model).inc()
        return decision

    def _home(self, key: APIKey, body: dict[str, Any]) -> str | None:
        """The replica a Responses continuation must go to; 404 for a response this key did not make here."""
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        home = self.homes.find(previous, key.namespace) if isinstance(previous, str) else None
        if home is None:
            raise APIError(404, f"no stored response has the id {previous!r}", param="previous_response_id",
                           code="not_found")
        return home.replica_url

    async def stored_response(self, response_id: str, request: Request) -> Response:
        """GET /v1/responses/{id}: from the replica that stored it, for the key that made it."""
        key = self._authenticate(request)
        home = self.homes.find(response_id, key.namespace)
        replica = next((r for r in self.pool.all() if home is not None and r.url == home.replica_url), None)
        if replica is None:
            raise APIError(404, f"no stored response has the id {response_id!r}", code="not_found")
        assert self.pool.session is not None
        try:
            async with self.pool.session.get(f"{replica.url}/v1/responses/{response_id}",
                                             headers=auth_headers(replica)) as response:
                body = await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise APIError(502, f"the replica that stored {response_id!r} did not answer ({type(e).__name__})",
                           code="upstream_error") from None
        if response.status != 200:
            raise _PassThrough(response.status, body)
        return Response(body, media_type="application/json")

    def _judge(self, model: str) -> Ask:
        """A judge router's way to ask its model."""
        ask = self._asker("chat", "router")
        return lambda request: ask(model, request)

    def _asker(self, route: str, namespace: str) -> Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]:
        """The gateway asking one of its models for itself (a judge, a scorer): through its own balancing, retries
        and accounting (the cost counted under `namespace`)."""
        async def ask(model: str, request: dict[str, Any]) -> dict[str, Any]:
            call = _Call(route, model, OPEN_NAMESPACE, {**request, "model": model}, False, False, None)
            replica, response, _ = await self._send(call)
            try:
                answer = orjson.loads(await response.read())
            except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as e:
                raise APIError(502, f"{model!r} failed: {e}", code="upstream_error") from None
            finally:
                response.release()
                replica.finished()
            replica.succeeded()
            self.metrics.cost.labels(model, namespace).inc(self.config.models[model].price.cost(answer.get("usage")))
            return answer

        return ask

    def _authenticate(self, request: Request) -> APIKey:
        if not self.keys:
            return OPEN_NAMESPACE
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            for key, entry in self.keys.items():  # constant time per key: timing must not reveal a prefix
                if hmac.compare_digest(given.strip().encode(), key.encode()):
                    return entry
        raise APIError(401, "missing or invalid API key (expected 'Authorization: Bearer <key>')",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _from_cache(self, call: _Call, kind: str, answer_bytes: bytes) -> Response:
        answer = orjson.loads(answer_bytes)
        usage = answer.get("usage") or {}
        self.metrics.saved_tokens.labels("prompt").inc(usage.get("prompt_tokens") or 0)
        self.metrics.saved_tokens.labels("completion").inc(usage.get("completion_tokens") or 0)
        self.metrics.requests.labels(call.model, "200").inc()
        saved = self.config.models[call.model].price.cost(usage)
        self.metrics.saved.labels(call.model, call.key.namespace, f"cache_{kind}").inc(saved)
        if isinstance(answer.get("usage"), dict):
            answer["usage"]["cost"] = 0.0
        fresh_identity(call.route, answer)
        headers = {**_route_headers(call), CACHE_HEADER: "hit" if kind == "exact" else kind,  # hit | semantic | miss
                   COST_HEADER: "0", SAVED_HEADER: _dollars(saved)}
        if call.stream:
            events = replay_events(call.route, answer, call.include_usage, call.model)
            return SSEResponse(_iterate(events), headers=headers)
        answer["model"] = call.model
        return Response(orjson.dumps(answer), media_type="application/json", headers=headers)

    # --- upstream --------------------------------------------------------------------------------

    async def _send(self, call: _Call) -> tuple[Replica, aiohttp.ClientResponse, float]:
        """A replica's 200 response (headers read), trying others on failure, leg after leg; APIError when none
        answers. The caller owns the response and the replica's outstanding count."""
        route = self.config.models[call.model]
        payload = dict(call.body)
        payload.pop("kv_transfer_params", None)  # never a caller's: it would make our replicas fetch from any URL
        if route.upstream_model:
            payload["model"] = route.upstream_model
        if call.stream and call.route != "responses":  # usage always: for the tokens/min limits and the cache
            payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
        path = _PATHS[call.route]
        prefix = prefix_chunks(call.body) if route.balancing == "prefix_aware" else []
        last: _UpstreamFailed | None = None
        for leg in await self._legs(call, route, payload, prefix):
            data = orjson.dumps(leg.payload)
            try:
                replica, response, sent = await self._attempts(call, leg.pool, prefix,
                                                               lambda r, data=data: self._post(r, path, data))
            except _Exhausted as e:
                last = e.last or last
                continue
            call.disaggregation = leg.header(replica.url)
            if leg.outcome is not None:
                self.metrics.disaggregated.labels(call.model, leg.outcome).inc()
            return replica, response, sent
        if last is not None and last.status is not None:  # the upstream's own error, as it sent it
            raise _PassThrough(last.status, last.body or b"")
        raise APIError(503, f"no replica of {call.model!r} could take the request"
                       + (f" (last error: {last})" if last else " (none is healthy)"),
                       code="no_healthy_upstream", headers={"Retry-After": "1"})

    async def _legs(self, call: _Call, route: ModelRoute, payload: dict[str, Any], prefix: list[bytes]) -> list[_Leg]:
        """Where the request goes, in order of fallback. A disaggregated model's chat or completion: after a
        prefill hop, its decode replicas told where the KV is, then its `upstreams`; after a failed prefill hop,
        its `upstreams` (else its decode replicas, which compute the prompt themselves). Its other routes: its
        `upstreams`, else its decode replicas."""
        if not route.prefill:
            return [_Leg(call.model, payload)]
        plain = call.model if route.upstreams else role_pool(call.model, "decode")
        if call.route not in _DISAGGREGATED:
            return [_Leg(plain, payload)]
        prefill = await self._prefill(call, payload, prefix)
        if prefill is None:
            return [_Leg(plain, payload, "fallback_prefill_failed")]
        remote = {"do_remote_prefill": True, "remote_url": prefill.url}
        legs = [_Leg(role_pool(call.model, "decode"), {**payload, "kv_transfer_params": remote}, "prefill_decode",
                     prefill.url)]
        if route.upstreams:
            legs.append(_Leg(call.model, payload, "fallback_decode_failed"))
        return legs

    async def _prefill(self, call: _Call, payload: dict[str, Any], prefix: list[bytes]) -> Replica | None:
        """The prefill hop: the prompt's KV computed into a prefill replica's prefix cache, for a decode replica to
        pull. Only its status matters. The replica that holds it; None when every try failed (an upstream's
        non-retryable answer, the request's own fault, is passed through)."""
        hop = {**payload, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True}}
        hop.pop("stream_options", None)
        if call.route == "chat" and "max_completion_tokens" in hop:
            hop["max_completion_tokens"] = 1
        data, path = orjson.dumps(hop), _PATHS[call.route]
        began = time.perf_counter()
        try:
            replica, _, sent = await self._attempts(call, role_pool(call.model, "prefill"), prefix,
                                                    lambda r: self._drained(r, path, data))
        except _Exhausted as e:
            logger.warning("%s: the prefill hop failed (%s); sending the request without it", call.model,
                           e.last or "no replica")
            return None
        replica.finished()
        replica.succeeded()
        now = time.perf_counter()
        self.metrics.upstream_latency.labels(replica.url).observe(now - sent)
        self.metrics.prefill_seconds.labels(call.model).observe(now - began)
        return replica

    async def _attempts(self, call: _Call, pool: str, prefix: list[bytes],
                        post: Callable[[Replica], Awaitable[aiohttp.ClientResponse]],
                        ) -> tuple[Replica, aiohttp.ClientResponse, float]:
        """`post`'s 200 response from one of `pool`'s replicas, trying others on failure, at most `retries` more;
        _Exhausted when none answered. The caller owns the response and the replica's outstanding count."""
        balancer = self.balancers[call.model]
        tried: set[str] = set()
        last: _UpstreamFailed | None = None
        for attempt in range(self.config.retries + 1):
            candidates = [r for r in self.pool.candidates(pool) if r.url not in tried and call.home in (None, r.url)]
            if not candidates:
                break
            if attempt:
                self.metrics.retries.labels(call.model).inc()
            replica = balancer.pick(candidates, prefix)
            tried.add(replica.url)
            replica.started(time.monotonic())
            sent = time.perf_counter()
            try:
                response = await post(replica)
            except _UpstreamFailed as e:
                replica.finished()
                self._failed(replica, e)
                last = e
                continue
            except BaseException:  # the request's own error, or its client gone (cancelled) while connecting
                replica.finished()
                raise
            self.metrics.upstream_ttfb.labels(replica.url).observe(time.perf_counter() - sent)
            return replica, response, sent
        raise _Exhausted(last)

    async def _post(self, replica: Replica, path: str, data: bytes) -> aiohttp.ClientResponse:
        assert self.pool.session is not None
        headers = {"Content-Type": "application/json", **auth_headers(replica)}
        try:
            response = await self.pool.session.post(replica.url + path, data=data, headers=headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise _UpstreamFailed(f"{type(e).__name__}: {e}") from None
        if response.status != 200:
            body = await _read_or_empty(response)
            if response.status in _RETRYABLE_UPSTREAM:
                raise _UpstreamFailed(f"HTTP {response.status}", response.status, body)
            raise _PassThrough(response.status, body)  # the request's own fault: no other replica would differ
        return response

    async def _drained(self, replica: Replica, path: str, data: bytes) -> aiohttp.ClientResponse:
        """_post, its answer read and let go (a prefill hop's body says nothing the gateway needs)."""
        response = await self._post(replica, path, data)
        try:
            await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise _UpstreamFailed(f"{type(e).__name__}: {e}") from None
        finally:
            response.release()
        return response

    def _failed(self, replica: Replica, e: _UpstreamFailed) -> None:
        kind = "timeout" if "Timeout" in str(e) else ("http" if e.status else "connection")
        self.metrics.upstream_errors.labels(replica.url, kind).inc()
        if replica.failed(self.config.health, str(e)):
            logger.warning("replica %s ejected", replica.url)

    async def _complete(self, call: _Call) -> Response:
        for _ in range(self.config.retries + 1):
            replica, response, sent = await self._send(call)
            try:
                body = await response.read()
            except (aiohttp.ClientError, TimeoutError, OSError) as e:  # died before we sent a byte: retry
                self._failed(replica, _UpstreamFailed(f"{type(e).__name__}: {e}"))
                continue
            finally:
                response.release()
                replica.finished()
            replica.succeeded()
            self.metrics.upstream_latency.labels(replica.url).observe(time.perf_counter() - sent)
            self.metrics.requests.labels(call.model, "200").inc()
            headers = {**_route_headers(call), CACHE_HEADER: "miss"}
            answer = _json_or_none(body)
            if isinstance(answer, dict):
                self._remember(call, replica, answer)
                cost = await self._account(call, answer, answer if call.plan is not None else None)
                if isinstance(answer.get("usage"), dict):
                    answer["usage"]["cost"] = cost
                    body = orjson.dumps(answer)
                headers[COST_HEADER] = _dollars(cost)
            return Response(body, media_type="application/json", headers=headers)
        raise APIError(502, "upstream connections failed while reading the answer", code="upstream_error")

    async def _stream(self, call: _Call, request: Request) -> Response:
        """Headers of a 200 only once an upstream has sent its first event: until then, failures retry."""
        for _ in range(self.config.retries + 1):
            replica, response, sent = await self._send(call)
            lease = _Lease(replica, response)
            events = _sse_events(response)
            try:
                first = await anext(events)
            except (aiohttp.ClientError, TimeoutError, OSError, StopAsyncIteration) as e:
                lease.release()
                self._failed(replica, _UpstreamFailed(f"stream ended before its first event ({type(e).__name__})"))
                continue
            except BaseException:
                lease.release()
                raise
            self.metrics.requests.labels(call.model, "200").inc()
            relay = self._relay(call, lease, events, first, sent)
            return SSEResponse(relay, headers={**_route_headers(call), CACHE_HEADER: "miss"}, on_close=lease.release)
        raise APIError(502, "upstream streams failed before their first event", code="upstream_error")

    async def _relay(self, call: _Call, lease: _Lease, events: AsyncIterator[bytes], first: bytes,
                     sent: float) -> AsyncGenerator[bytes, None]:
        """Forward the upstream's events as they come; the answer is accounted (and cached) before [DONE] goes
        out, since a client may hang up the moment it reads [DONE]."""
        replica = lease.replica
        assembler = StreamAssembler(call.route)
        # parse every event only to cache the answer; else only the usage chunk (choices: []), which is read
        # for the tokens/min budget and withheld from a client that did not ask for it
        assemble = call.plan is not None
        done = False
        try:
            event: bytes | None = first
            while event is not None:
                if call.route == "responses":  # typed events: the first names the response, the last ends it
                    done = await self._response_event(call, replica, assembler, event, sent)
                elif event.startswith(b"data: [DONE]"):
                    done = True
                    await self._finished_stream(call, replica, assembler, sent)
                elif event.startswith(b"data:") and (assemble or _EMPTY_CHOICES[0] in event
                                                     or _EMPTY_CHOICES[1] in event):
                    parsed = _json_or_none(event[5:])
                    if isinstance(parsed, dict):
                        assembler.feed(parsed)
                        if isinstance(parsed.get("usage"), dict) and not parsed.get("choices"):
                            if not call.include_usage:  # the usage chunk the gateway asked for, not the client
                                event = await anext(events, None)
                                continue
                            parsed["usage"]["cost"] = self.config.models[call.model].price.cost(parsed["usage"])
                            event = b"data: " + orjson.dumps(parsed) + b"\n\n"
                yield event
                if done:
                    return
                event = await anext(events, None)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self._failed(replica, _UpstreamFailed(f"stream broken: {type(e).__name__}"))
            for event in _stream_error(call.route, APIError(502, f"the upstream stream broke ({type(e).__name__})",
                                                            code="upstream_error")):
                yield event
            return
        finally:
            lease.release(clean=done)  # else aborts the upstream request (a client that left, a broken stream)
        self._failed(replica, _UpstreamFailed("stream ended without its last event"))
        for event in _stream_error(call.route, APIError(502, "the upstream stream ended early", code="upstream_error")):
            yield event

    async def _response_event(self, call: _Call, replica: Replica, assembler: StreamAssembler, event: bytes,
                              sent: float) -> bool:
        """Read one Responses stream event on its way to the client; True when it is the last."""
        final = event.startswith(_RESPONSE_FINAL)
        if final or event.startswith(b"event: response.created"):
            _, _, data = event.partition(b"\ndata: ")
            parsed = _json_or_none(data)
            response = parsed.get("response") if isinstance(parsed, dict) else None
            if isinstance(response, dict):
                self._remember(call, replica, response)
                assembler.usage = response.get("usage") or assembler.usage
        if final:
            await self._finished_stream(call, replica, assembler, sent)
        return final

    def _remember(self, call: _Call, replica: Replica, answer: dict[str, Any]) -> None:
        """A Responses answer's home, for its continuations and reads."""
        if call.route == "responses" and isinstance(answer.get("id"), str) and answer.get("store", True) is not False:
            self.homes.put(answer["id"], call.key.namespace, replica.url)

    async def _finished_stream(self, call: _Call, replica: Replica, assembler: StreamAssembler, sent: float) -> None:
        replica.succeeded()
        self.metrics.upstream_latency.labels(replica.url).observe(time.perf_counter() - sent)
        answer = assembler.result() if call.plan is not None else None
        await self._account(call, answer or {"usage": assembler.usage}, answer)

    async def _account(self, call: _Call, answer: dict[str, Any], cacheable: dict[str, Any] | None) -> float:
        """Spend the key's token budget and count the dollars; cache the answer. Returns its cost."""
        usage = answer.get("usage") or {}
        self.limiter.spend(call.key, int(usage.get("total_tokens") or 0))
        cost = self.config.models[call.model].price.cost(usage)
        self.metrics.cost.labels(call.model, call.key.namespace).inc(cost)
        if call.decision is not None and not call.decision.chose_strong:
            # against the strong model's price for the same tokens (its own answer's length is unknown)
            strong = self.config.models[call.decision.strong_model].price.cost(usage)
            self.metrics.saved.labels(call.model, call.key.namespace, "routing").inc(max(0.0, strong - cost))
        if call.compression is not None and call.compression.removed:  # the removed tokens at the input price
            removed = call.compression.removed
            self.metrics.compression_removed_tokens.labels(call.model).inc(removed)
            self.metrics.saved.labels(call.model, call.key.namespace, "compression").inc(
                self.config.models[call.model].price.cost({"prompt_tokens": removed}))
        if cacheable is not None and call.plan is not None and replayable(call.route, cacheable):
            await self.cache.put(call.plan, orjson.dumps(cacheable))
        return cost


class _PassThrough(APIError):
    """An upstream's own non-retryable answer (e.g. 400 for a bad parameter), sent on as it came."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status, body.decode("utf-8", "replace"))
        self.body = body

    def response(self) -> Response:  # type: ignore[override]
        media = "application/json" if _json_or_none(self.body) is not None else "text/plain"
        return Response(self.body, status_code=self.status, media_type=media)


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        _log_isolation(config)
        logger.info("gateway serving %s", ", ".join(f"{name} ({_replicas_said(r)}, {r.balancing})"
                                                    for name, r in config.models.items()))
        yield
        await gateway.close()

    app = FastAPI(title="llmserve gateway", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway
    install_handlers(app)

    app.add_middleware(RequestBodyMiddleware, max_bytes=config.max_request_body_bytes, timeout=30.0)
    app.add_middleware(AdminGate, admin_key=config.admin_key, protected=config.admin_protected)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gateway.handle("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle("completions", request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await gateway.handle("embeddings", request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await gateway.handle("responses", request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request) -> Response:
        return await gateway.stored_response(response_id, request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        gateway._authenticate(request)
        now = int(time.time())
        cards = await asyncio.gather(*(gateway.pool.model_card(name) for name in config.models))
        upstream = dict(zip(config.models, cards, strict=True))  # a replica's root, max_model_len, ...
        return JSONResponse({"object": "list", "data": [
            {**upstream.get(name, {}), "id": name, "object": "model", "created": now, "owned_by": "llmserve-gateway"}
            for name in (*config.models, *config.routers)]})

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        available = {pool: len(gateway.pool.available(pool)) for pool in gateway.pool.replicas}  # role pools too
        ok = any(available.values())
        return JSONResponse({"status": "ok" if ok else "no healthy upstream", "replicas": available},
                            status_code=200 if ok else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(dashboard.page())

    @app.get("/dashboard/data")
    async def dashboard_data() -> JSONResponse:
        return JSONResponse(dashboard.snapshot(gateway.metrics.registry))

    return app


def _replicas_said(route: ModelRoute) -> str:
    said = f"{len(route.upstreams)} upstream(s)"
    return said + (f", {len(route.prefill)} prefill + {len(route.decode)} decode" if route.prefill else "")


def _log_isolation(config: GatewayConfig) -> None:
    """Who shares what, said once at start-up: an operator should never learn it from a leak."""
    if not config.keys:
        logger.warning("no API keys: the gateway is open, and every caller shares one namespace (its cached "
                       "answers, limits and costs)")
    for namespace, n in config.shared_namespaces().items():
        logger.warning("namespace %r is shared on purpose by %d keys: their callers get each other's cached "
                       "answers", namespace, n)
    if config.admin_protected:
        logger.info("admin pages (/dashboard, /metrics, /docs): %s", "the admin key" if config.admin_key
                    else "closed (no admin key)")
    elif config.keys:
        logger.warning("admin pages (/dashboard, /metrics, /docs) are open to anyone (open_admin)")


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
    """The upstream's SSE events, each as its lines + a blank line (comments and keep-alives dropped)."""
    lines: list[bytes] = []
    async for line in response.content:
        line = line.rstrip(b"\r\n")
        if line:
            if not line.startswith(b":"):
                lines.append(line)
        elif lines:
            yield b"\n".join(lines) + b"\n\n"
            lines = []
    if lines:
        yield b"\n".join(lines) + b"\n\n"


def _stream_error(route: str, error: APIError) -> list[bytes]:
    """A stream's failure as its own protocol says it: the Responses API's `error` event, else the error
    envelope as an event and [DONE]."""
    if route == "responses":
        return [b"event: error\ndata: " + orjson.dumps({"type": "error", "code": error.code, "message": error.message,
                                                        "param": error.param}) + b"\n\n"]
    return [error.sse_event(), SSE_DONE]


async def _iterate(items: list[bytes]) -> AsyncGenerator[bytes, None]:
    for item in items:
        yield item


async def _read_or_empty(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return b""
    finally:
        response.release()


def _route_headers(call: _Call) -> dict[str, str]:
    """What routing and compression did to the request."""
    headers = {}
    if call.decision is not None:
        headers = {ROUTE_HEADER: call.decision.model, f"{ROUTE_HEADER}-reason": call.decision.reason()}
    compression = call.compression.header() if call.compression is not None else None
    if compression is not None:
        headers[COMPRESSION_HEADER] = compression
    if call.disaggregation is not None:
        headers[DISAGGREGATION_HEADER] = call.disaggregation
    return headers


def _dollars(value: float) -> str:
    return f"{value:.10g}"


def _json_or_none(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _semantic_cache(config: GatewayConfig, store: CacheStore, embedder: Embedder) -> SemanticCache:
    from llmserve.gateway.cache.semantic import SemanticCache  # hnswlib: only where switched on

    return SemanticCache(store, embedder, threshold=config.cache.semantic_threshold, ttl=config.cache.ttl)

