"""A small real OpenAI-compatible streaming server for the bench tests (aiohttp.web in a thread).

Its behaviour is chosen by the first path segment, so one server serves every scenario:
  http://127.0.0.1:PORT/<mode>/v1/chat/completions
Modes:
  paced       first token after 100 ms, then one token every 20 ms, 16 tokens, usage chunk, [DONE]
  grouped     as paced, but stream chunk 5 carries two tokens (tokens 5 and 6, sent together)
  grouped-nousage   as grouped, without the usage chunk
  fast        10 ms to first token, 2 ms per token, 8 tokens
  flaky       fast, but every 3rd request (1-based) answers 500 and the 5th answers an HTML page (200)
  html        every request answers an HTML page with status 200
  slow        waits 3 s before answering (for timeouts)
  strict      400 when the body has ignore_eos (like the real OpenAI API), else fast
  cut         sends 3 tokens then drops the connection
Any other path answers aiohttp's 404. With `root_mode`, /v1/... (no mode segment) behaves as that mode.
Run standalone (a stand-in for a real server in subprocess tests):
  python -m tests.bench.fake_server --port 8123 --root-mode fast
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Pace:
    ttft: float = 0.100
    itl: float = 0.020
    tokens: int = 16
    groups: dict[int, int] = field(default_factory=dict)  # chunk index -> tokens in that chunk
    usage: bool = True


PACES = {
    "paced": Pace(),
    "grouped": Pace(groups={5: 2}),
    "grouped-nousage": Pace(groups={5: 2}, usage=False),
    "fast": Pace(ttft=0.010, itl=0.002, tokens=8),
}
HTML = b"<!DOCTYPE html>\n<html><head><title>Welcome</title></head>\n<body>It works!</body></html>\n"


def token_text(i: int) -> str:
    return f" t{i:02d}"


class FakeOpenAIServer:
    """Start with `start()`; `base(mode)` gives the base URL; `requests` records what was received."""

    def __init__(self, root_mode: str | None = None, port: int = 0) -> None:
        self.root_mode = root_mode
        self.requests: list[dict[str, Any]] = []
        self.counters: dict[str, int] = {}
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    def base(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"

    # ---- handlers

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info.get("mode") or self.root_mode or "fast"
        chat = request.path.endswith("/chat/completions")
        body = await request.json()
        self.requests.append({"mode": mode, "path": request.path, "body": body,
                              "headers": dict(request.headers)})
        n = self.counters[mode] = self.counters.get(mode, 0) + 1
        if mode == "html" or (mode == "flaky" and n == 5):
            return web.Response(body=HTML, content_type="text/html")
        if mode == "flaky" and n % 3 == 0:
            return web.json_response({"error": {"message": "internal error", "type": "server_error"}},
                                     status=500)
        if mode == "slow":
            await asyncio.sleep(3.0)
        if mode == "strict" and "ignore_eos" in body:
            return web.json_response({"error": {"message": "Unrecognized request argument: ignore_eos"}},
                                     status=400)
        pace = PACES.get(mode, PACES["fast"])
        if mode in PACES or mode in ("flaky", "strict", "slow", "cut"):
            return await self._stream(request, pace, chat, body, cut_after=3 if mode == "cut" else None)
        raise web.HTTPNotFound()

    async def _stream(self, request: web.Request, pace: Pace, chat: bool, body: dict[str, Any],
                      cut_after: int | None) -> web.StreamResponse:
        t0 = time.perf_counter()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        def event(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return {"id": "x", "object": "chat.completion.chunk", "model": "fake-model",
                        "choices": [choice]}
            return {"id": "x", "object": "text_completion", "model": "fake-model",
                    "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}

        if chat:
            first = chunk(None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await resp.write(event(first))
        tok = 0
        ci = 0
        while tok < pace.tokens:
            k = min(pace.groups.get(ci, 1), pace.tokens - tok)
            last = tok + k - 1
            due = t0 + pace.ttft + last * pace.itl
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(event(chunk("".join(token_text(i) for i in range(tok, tok + k)))))
            tok += k
            ci += 1
            if cut_after is not None and tok >= cut_after:
                assert request.transport is not None
                request.transport.close()
                return resp
        await resp.write(event(chunk(None if chat else "", "length")))
        if pace.usage:
            prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])) or len(
                str(body.get("prompt", "")).split())
            usage = {"prompt_tokens": prompt, "completion_tokens": pace.tokens,
                     "total_tokens": prompt + pace.tokens}
            final = {"id": "x", "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await resp.write(event(final))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- lifecycle

    def start(self) -> FakeOpenAIServer:
        sock = socket.socket()
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._serve(sock))
        loop.close()

    async def _serve(self, sock: socket.socket) -> None:
        app = web.Application()
        app.router.add_get("/{mode}/v1/models", self.models)
        app.router.add_post("/{mode}/v1/chat/completions", self.completions)
        app.router.add_post("/{mode}/v1/completions", self.completions)
        if self.root_mode:
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/chat/completions", self.completions)
            app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)


def main() -> None:
    import argparse
    import signal

    ap = argparse.ArgumentParser(description="fake OpenAI-compatible streaming server (bench tests)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--root-mode", default="fast", help="behaviour of /v1/... (see module doc)")
    args = ap.parse_args()
    srv = FakeOpenAIServer(root_mode=args.root_mode, port=args.port).start()
    print(f"fake OpenAI server on http://127.0.0.1:{srv.port}/v1 (mode {args.root_mode})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    srv.stop()


if __name__ == "__main__":
    main()
