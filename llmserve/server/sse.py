"""Server-sent events and client disconnects, for any route that streams: the engine's server and the gateway.

A client that goes away must stop the work done for it at once (an engine request, an upstream request),
so every long-running answer is awaited beside a watcher of the ASGI `receive` channel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer the stream


class SSEResponse(Response):
    """A 200 text/event-stream that writes each bytes item of `events` as one body message.

    Instead of Starlette's StreamingResponse, whose chunks pass through an anyio task group's wrapper
    frames and a type check on their way to `send`, a noticeable share of what the whole server path takes
    in Python per token (docs/performance.md, "Served against llama.cpp and vLLM-CPU"). A client that goes away
    cancels the writer, and `events` is closed at once, aborting its engine requests, even when the writer was
    cancelled in `send` rather than in `events`.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.on_close = on_close  # runs however the response ends, even where `events` never started
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            writer = asyncio.ensure_future(self._write(send))
            await _cancel_on_disconnect(writer, receive)
            if not writer.cancelled():
                writer.result()  # a failure to send raises here, for the server to log
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _write(self, send: Send) -> None:
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work`, cancelling it if the client goes away first (its generation is then aborted).

    For non-streaming responses: nothing is sent until the end, so a departed client would
    otherwise be noticed only after its whole generation.
    """
    task = asyncio.ensure_future(work)
    await _cancel_on_disconnect(task, request.receive)
    if task.cancelled() or not task.done():
        logger.info("client disconnected from %s; request aborted", request.url.path)
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
    return task.result()


async def _cancel_on_disconnect(task: asyncio.Future, receive: Receive) -> None:
    """Wait for `task`; if the client goes away first, cancel it and wait for it to unwind."""
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
