"""Streaming OpenAI-compatible HTTP client that timestamps every token, and classifies every failure.

Why its own client (not the `openai` SDK): we need the arrival time of each SSE event as it comes off
the socket, tolerance for servers that are only roughly OpenAI-compatible, and failures turned into
counted error kinds instead of exceptions, so one bad request never stops a benchmark run.

Timing (all from `time.perf_counter()`, relative to the moment the request is sent):
  TTFT     send -> first SSE event carrying non-empty content (connection setup included, as a user
           sees); content = delta.content (+ reasoning_content) for chat, choices[].text for completions
  ITL      per-token gaps. A chunk (one network read of SSE events) may carry k > 1 tokens; we then
           record its gap divided evenly over its k tokens (k entries of gap / k), so ITL samples are
           per token and their mean matches TPOT. Extra tokens inside the *first* chunk get 0-gaps (they
           arrived with the first token). Raw chunk arrival times and per-chunk token counts are kept in
           the record, so the burstiness of a server that batches tokens stays visible.
  TPOT     (last content arrival - first content arrival) / (output_tokens - 1)
  E2E      send -> end of stream ([DONE] or EOF)

Tokens per chunk: with a tokenizer, the streamed text is tokenized once and each token is attributed
to the chunk holding its last character; without one, each chunk counts 1. If the server reports
`usage.completion_tokens` (we ask for it with stream_options.include_usage), that total wins: missing
tokens go to the chunks with the most characters per counted token (surplus is taken from the fewest),
keeping at least one per chunk. Output tokens = usage when sent, else max(tokenizer count, chunks).

Error kinds: connect, timeout, http_<status>, malformed (not an SSE stream of JSON: HTML page, a plain
JSON body, garbage), stream_error (an error object inside the stream), disconnect (stream cut short),
empty (stream ended without any content), client (anything else, e.g. an invalid URL).
"""

from __future__ import annotations

import asyncio
import heapq
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from llmserve.bench.tokens import TokenCounter
from llmserve.bench.workload import BenchRequest

ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}
_SNIPPET = 300
_MAX_ERROR_BODY = 64 * 1024


def api_root(base_url: str) -> str:
    """`http://host:port` or `http://host:port/v1` -> `http://host:port/v1` (no trailing slash)."""
    root = base_url.strip().rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


@dataclass
class ClientConfig:
    """How requests are sent; one per run."""

    base_url: str
    model: str
    endpoint: str = "chat"  # "chat" -> /v1/chat/completions, "completions" -> /v1/completions
    api_key: str | None = None
    request_timeout: float = 600.0  # seconds, whole request (connect + stream)
    ignore_eos: bool = True
    include_usage: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    keepalive: bool = False  # default: a fresh connection per request (some servers break keep-alive)

    @property
    def url(self) -> str:
        return api_root(self.base_url) + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    """Everything measured about one request; times in seconds (ms in JSON, see to_json)."""

    stream: str
    index: int
    max_tokens: int = 0
    prompt_tokens_expected: int = 0
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    start_s: float = 0.0  # send time relative to the level start
    ttft_s: float | None = None
    latency_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)  # content chunk arrivals, from send
    chunk_tokens: list[int] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = ""  # usage | tokenizer | chunks
    prompt_tokens: int | None = None  # as reported by the server (usage)
    finish_reason: str | None = None
    text: str = ""

    def fail(self, kind: str, message: str) -> RequestRecord:
        self.ok = False
        self.error_kind = kind
        self.error = message[:_SNIPPET]
        return self

    def to_json(self) -> dict[str, Any]:
        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1000.0, 3)

        return {
            "stream": self.stream,
            "index": self.index,
            "ok": self.ok,
            "error_kind": self.error_kind,
            "error": self.error,
            "http_status": self.http_status,
            "start_ms": ms(self.start_s),
            "ttft_ms": ms(self.ttft_s),
            "latency_ms": ms(self.latency_s),
            "tpot_ms": ms(self.tpot_s),
            "itl_ms": [ms(x) for x in self.itl_s],
            "chunk_times_ms": [ms(x) for x in self.chunk_times_s],
            "chunk_tokens": self.chunk_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_source": self.output_tokens_source,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_expected": self.prompt_tokens_expected,
            "max_tokens": self.max_tokens,
            "finish_reason": self.finish_reason,
            "text": self.text[:200],
        }


def allocate_chunk_tokens(pieces: list[str], total: int | None, counter: TokenCounter | None) -> list[int]:
    """Tokens carried by each content chunk (>= 1 each), summing to `total` when total >= len(pieces).

    See the module docstring for the rule; `total` None means "no server count: trust the tokenizer".
    """
    n = len(pieces)
    if n == 0:
        return []
    base = counter.tokens_per_piece(pieces) if counter is not None and counter.exact else [1] * n
    counts = [max(1, c) for c in base]
    if total is None or total < n:
        return counts if total is None else [1] * n
    diff = total - sum(counts)
    if diff > 0:  # give tokens to the chunks with the most characters per token
        heap = [(-(len(p) + 1) / c, i) for i, (p, c) in enumerate(zip(pieces, counts, strict=True))]
        heapq.heapify(heap)
        for _ in range(diff):
            _, i = heapq.heappop(heap)
            counts[i] += 1
            heapq.heappush(heap, (-(len(pieces[i]) + 1) / counts[i], i))
    elif diff < 0:  # take tokens back from the chunks with the fewest characters per token
        heap = [((len(p) + 1) / c, i) for i, (p, c) in enumerate(zip(pieces, counts, strict=True)) if c > 1]
        heapq.heapify(heap)
        for _ in range(-diff):
            _, i = heapq.heappop(heap)
            counts[i] -= 1
            if counts[i] > 1:
                heapq.heappush(heap, ((len(pieces[i]) + 1) / counts[i], i))
    return counts


def per_token_gaps(times: list[float], counts: list[int]) -> list[float]:
    """ITL samples: k-1 zeros for the first chunk, then each later gap split evenly over its k tokens."""
    if not times:
        return []
    gaps = [0.0] * (counts[0] - 1)
    for j in range(1, len(times)):
        k = counts[j]
        gaps.extend([(times[j] - times[j - 1]) / k] * k)
    return gaps


def _content_of(obj: dict[str, Any], endpoint: str) -> tuple[str, str | None]:
    text_parts: list[str] = []
    finish = None
    for ch in obj.get("choices") or []:
        if not isinstance(ch, dict):
            continue
        if endpoint == "chat":
            delta = ch.get("delta") or {}
            for key in ("content", "reasoning_content", "reasoning"):
                v = delta.get(key)
                if isinstance(v, str):
                    text_parts.append(v)
        else:
            v = ch.get("text")
            if isinstance(v, str):
                text_parts.append(v)
        finish = ch.get("finish_reason") or finish
    return "".join(text_parts), finish


class BenchClient:
    """One aiohttp session; `send()` never raises for server/network trouble, it returns a failed record."""

    def __init__(self, cfg: ClientConfig, counter: TokenCounter | None = None, connections: int = 0) -> None:
        self.cfg = cfg
        self.counter = counter
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> BenchClient:
        connector = aiohttp.TCPConnector(limit=self.connections, force_close=not self.cfg.keepalive)
        self._session = aiohttp.ClientSession(connector=connector, headers=self.cfg.headers())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def body(self, req: BenchRequest) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": cfg.model,
            "max_tokens": req.max_tokens,
            "temperature": cfg.temperature,
            "stream": True,
        }
        if cfg.endpoint == "chat":
            body["messages"] = req.messages
        else:
            body["prompt"] = req.text
        if cfg.include_usage:
            body["stream_options"] = {"include_usage": True}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        body.update(cfg.extra_body)
        return body

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(stream=req.stream, index=req.index, max_tokens=req.max_tokens,
                            prompt_tokens_expected=req.prompt_len)
        if self._session is None:
            raise RuntimeError("BenchClient must be used as `async with BenchClient(...)`")
        t0 = time.perf_counter()
        pieces: list[str] = []
        times: list[float] = []
        usage: dict[str, Any] | None = None
        try:
            async with asyncio.timeout(self.cfg.request_timeout):
                async with self._session.post(self.cfg.url, json=self.body(req)) as resp:
                    rec.http_status = resp.status
                    if resp.status != 200:
                        raw = await resp.content.read(_MAX_ERROR_BODY)
                        return rec.fail(f"http_{resp.status}", raw.decode("utf-8", "replace").strip())
                    buf = b""
                    done = False
                    async for data in resp.content.iter_any():
                        now = time.perf_counter() - t0
                        buf += data
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            line = line.strip()
                            if not line or line.startswith(b":") or line.split(b":", 1)[0] in (
                                b"event", b"id", b"retry"):
                                continue
                            if not line.startswith(b"data:"):
                                return rec.fail("malformed", "not an SSE stream: "
                                                + line.decode("utf-8", "replace"))
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                done = True
                                break
                            try:
                                obj = json.loads(payload)
                            except ValueError:
                                return rec.fail("malformed", "SSE data is not JSON: "
                                                + payload.decode("utf-8", "replace"))
                            if not isinstance(obj, dict):
                                return rec.fail("malformed", f"SSE data is not a JSON object: {obj!r}")
                            if obj.get("error") or obj.get("object") == "error":
                                err = obj.get("error", obj)
                                return rec.fail("stream_error", json.dumps(err)[:_SNIPPET])
                            if isinstance(obj.get("usage"), dict):
                                usage = obj["usage"]
                            text, finish = _content_of(obj, self.cfg.endpoint)
                            if finish:
                                rec.finish_reason = finish
                            if text:
                                if times and times[-1] == now:  # same network read: one chunk
                                    pieces[-1] += text
                                else:
                                    pieces.append(text)
                                    times.append(now)
                        if done:
                            break
                    if buf.strip() and not buf.strip().startswith(b"data:") and not pieces:
                        return rec.fail("malformed", "not an SSE stream: " + buf.decode("utf-8", "replace"))
            rec.latency_s = time.perf_counter() - t0
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                return rec.fail("connect", f"connection timed out: {exc}")
            return rec.fail("timeout", f"no complete answer within {self.cfg.request_timeout:g} s")
        except aiohttp.ClientConnectorError as exc:
            return rec.fail("connect", f"{type(exc).__name__}: {exc}")
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            self._finish(rec, pieces, times, usage)
            return rec.fail("disconnect", f"{type(exc).__name__}: {exc}")
        except aiohttp.ClientResponseError as exc:  # e.g. not HTTP at all
            return rec.fail("malformed", f"{type(exc).__name__}: {exc}")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return rec.fail("client", f"{type(exc).__name__}: {exc}")
        self._finish(rec, pieces, times, usage)
        if not pieces:
            return rec.fail("empty", "stream ended without any content")
        rec.ok = True
        return rec

    def _finish(self, rec: RequestRecord, pieces: list[str], times: list[float],
                usage: dict[str, Any] | None) -> None:
        """Token accounting after the stream (keeps tokenizer work out of the timed read loop)."""
        rec.text = "".join(pieces)
        if usage is not None:
            pt = usage.get("prompt_tokens")
            rec.prompt_tokens = int(pt) if isinstance(pt, int | float) else None
        if not pieces:
            return
        server_total = usage.get("completion_tokens") if usage is not None else None
        if isinstance(server_total, int | float) and server_total > 0:
            total: int | None = int(server_total)
            rec.output_tokens_source = "usage"
        elif self.counter is not None and self.counter.exact:
            total = max(self.counter.count(rec.text), len(pieces))
            rec.output_tokens_source = "tokenizer"
        else:
            total = len(pieces)
            rec.output_tokens_source = "chunks"
        counts = allocate_chunk_tokens(pieces, total, self.counter)
        rec.chunk_times_s = times
        rec.chunk_tokens = counts
        rec.output_tokens = int(total) if total is not None else sum(counts)
        rec.ttft_s = times[0]
        rec.itl_s = per_token_gaps(times, counts)
        if rec.output_tokens > 1:
            rec.tpot_s = (times[-1] - times[0]) / (rec.output_tokens - 1)


async def detect_model(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str | None:
    """First model id from GET /v1/models, or None when the server does not say (or is unreachable)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with asyncio.timeout(timeout), aiohttp.ClientSession(headers=headers) as session:
            async with session.get(api_root(base_url) + "/models") as resp:
                if resp.status != 200:
                    return None
                doc = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return None
