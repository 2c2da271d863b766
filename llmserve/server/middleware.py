"""ASGI gates that run before any route: draining, API key, body size.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and the `receive` channel,
which the routes watch for client disconnects, pass through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.server.errors import error_body

API_PREFIX = "/v1"


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        + (headers or []),
    })
    await send({"type": "http.response.body", "body": body})


class GateMiddleware:
    """Refuses /v1 requests while draining (503) or without the API key (401).

    /health, /metrics and /version stay open: probes and scrapers carry no key, and a load balancer
    must see the 503 of /health to stop sending traffic here.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            return await self.app(scope, receive, send)
        if self._is_draining():
            return await _answer(send, 503, error_body(503, "server is shutting down"), [(b"connection", b"close")])
        if self._expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            # constant-time comparison: the time taken must not tell how much of the key matched
            if not hmac.compare_digest(given, self._expected):
                body = error_body(401, "missing or invalid API key (expected 'Authorization: Bearer <key>')",
                                  code="invalid_api_key")
                return await _answer(send, 401, body, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, judged by Content-Length and by the bytes that arrive.

    The body is read here (it is small by construction) and replayed to the app; after it, `receive`
    is the server's own, so the app still hears `http.disconnect`.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = error_body(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                               code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _answer(send, 413, too_large, [(b"connection", b"close")])
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body; nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _answer(send, 413, too_large, [(b"connection", b"close")])
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
