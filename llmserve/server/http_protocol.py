"""uvicorn's HTTP protocol with the two limits it lacks: a deadline for a request's headers and a cap
on open connections.

uvicorn times out only idle keep-alive connections: a client that connects and sends nothing, or sends
half its headers, holds a connection (a file descriptor, a task slot) for ever, and a few hundred such
clients starve the server. Here a request's headers must arrive within `header_timeout` seconds of its
first byte (of the connection, for a first request): else 408 in OpenAI's envelope and the connection
closes; a connection that sent nothing is closed silently. The body's deadline is kept where the body
is read (`RequestBodyMiddleware`). Past `max_connections` open connections, a request is marked
(`OVER_CAPACITY` in its scope) and the gate answers it 503 with Retry-After, in the envelope.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmserve.server.errors import error_body

OVER_CAPACITY = "llmserve.over_capacity"  # scope key: the request came past the connection cap


class LimitedHttpProtocol(HttpToolsProtocol):
    """Use `limited_http_protocol(...)`, which sets the limits."""

    header_timeout: float = 30.0
    max_connections: int = 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_headers = False  # a request has begun and its headers are not complete
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._cancel_header_timer()
        if len(self.connections) > self.max_connections:
            self.scope[OVER_CAPACITY] = True  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_header_timer()  # a pipelined request waits while the one before it is answered
            return
        if self._in_headers:
            body = error_body(408, f"the request's headers did not arrive within {self.header_timeout:g} s",
                              code="request_timeout")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def limited_http_protocol(header_timeout: float, max_connections: int) -> type[LimitedHttpProtocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`), with these limits."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
