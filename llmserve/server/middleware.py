"""ASGI gates that run before any route: capacity, draining, API key, and the request body's type,
size and deadline; and the request id every answer carries.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and the `receive` channel,
which the routes watch for client disconnects, pass through untouched.
"""

from __future__ import annotations

import asyncio
import email.message
import hmac
import re
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.server.errors import error_body
from llmserve.server.http_protocol import OVER_CAPACITY

API_PREFIX = "/v1"
# Probes and scrapers carry no key, and a load balancer must see the 503 of /health to stop sending
# traffic here; everything else (the API, /docs, /openapi.json, /redoc) needs the key when one is set.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
CLOSE = [(b"connection", b"close")]


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        + (headers or []),
    })
    await send({"type": "http.response.body", "body": body})


REQUEST_ID = b"x-request-id"
_SANE_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe to log and to echo


class RequestIdMiddleware:
    """Every answer (errors included) carries `x-request-id`: the client's own where it sent a sane one, else a
    new one, so a client, a proxy and this server's logs name the same request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(REQUEST_ID, b"")
        request_id = given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class GateMiddleware:
    """Refuses requests past the connection cap (503), /v1 requests while draining (503), and requests
    outside OPEN_PATHS without the API key (401).

    The key is read from `Authorization: Bearer KEY`, the scheme in any case (RFC 7235).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get(OVER_CAPACITY):
            body = error_body(503, "the server has too many open connections (--max-connections); retry later",
                              code="too_many_connections")
            return await _answer(send, 503, body, [(b"retry-after", b"1"), *CLOSE])
        path = scope["path"]
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if path.startswith(API_PREFIX) and self._is_draining():
            return await _answer(send, 503, error_body(503, "server is shutting down"), CLOSE)
        if self._key is not None and not self._has_key(scope):
            body = error_body(401, "missing or invalid API key (expected 'Authorization: Bearer <key>')",
                              code="invalid_api_key")
            return await _answer(send, 401, body, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)

    def _has_key(self, scope: Scope) -> bool:
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # constant-time comparison: the time taken must not tell how much of the key matched
        return hmac.compare_digest(given.strip(), self._key) and scheme.lower() == b"bearer"


class RequestBodyMiddleware:
    """The body of a POST: JSON (else 415), at most `max_bytes` (else 413, judged by Content-Length
    and by the bytes that arrive), all of it within `timeout` seconds (else 408: a client that sends
    less than its Content-Length would hold the connection for ever).

    The body is read here (it is small by construction) and replayed to the app; after it, `receive`
    is the server's own, so the app still hears `http.disconnect`.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type")
        if content_type is not None and not _is_json(content_type.decode("latin-1")):
            body = error_body(415, f"the request body must be JSON (Content-Type: application/json), "
                              f"not {content_type.decode('latin-1')!r}", code="unsupported_media_type")
            return await _answer(send, 415, body, CLOSE)
        too_large = error_body(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                               code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _answer(send, 413, too_large, CLOSE)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left before sending its body; nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        return await _answer(send, 413, too_large, CLOSE)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            body = error_body(408, f"the request body did not arrive within {self.timeout:g} s",
                              code="request_timeout")
            return await _answer(send, 408, body, CLOSE)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
