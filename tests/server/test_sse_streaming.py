"""The SSE path without a model: hand-rendered chunks against pydantic's, admission, failures, disconnects.

A stub `AsyncLLM` yields scripted outputs, so each case runs in milliseconds and can check bytes on
the wire, which the end-to-end tests (official client, real server) only see parsed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from llmserve.engine.async_engine import NewRequest, QueueFullError, RequestFailedError
from llmserve.engine.input_processor import InputProcessor
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.server.errors import APIError
from llmserve.server.metrics import ServerMetrics
from llmserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from llmserve.server.serving_chat import OpenAIServingChat
from llmserve.server.serving_completion import OpenAIServingCompletion
from llmserve.server.serving_engine import ModelInfo, TextChunk
from llmserve.server.sse import SSEResponse

# Everything JSON escapes (quote, backslash, every control character), what it must not (DEL, '/', non-ASCII,
# U+2028), multi-byte UTF-8 and text that looks like JSON or SSE framing.
TRICKY = ['plain', ' "quoted"', "back\\slash", "new\nline", "\r\n\t", "".join(map(chr, range(32))), "\x7f/",
          "é ü ß", "日本語", "🌊👍🏽", "\u2028\u2029", '{"a": [1]}', "data: [DONE]\n\n", "\ud7ff\ue000\uffff", ""]


class StubLLM:
    """`AsyncLLM.add_requests` from a script: the texts of successive outputs, then finished ("length")."""

    def __init__(self, pieces: list[str], refuse: BaseException | None = None, fail_after: int | None = None,
                 logprobs: bool = False) -> None:
        self.pieces = pieces
        self.refuse = refuse
        self.fail_after = fail_after
        self.logprobs = logprobs
        self.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=True: [1, 2, 3],
                                         apply_chat_template=lambda messages, **kwargs: "chat")
        self.processor = InputProcessor(self.tokenizer, "template", vocab_size=1000, max_model_len=1000,
                                        kv_cache_tokens=10000)
        # token i is pieces[i]; token i + 100 is the runner-up "x" (see the logprobs below)
        self.token_bytes = {i: p.encode() for i, p in enumerate(pieces)} | {i + 100: b"x" for i in range(len(pieces))}
        self.aborted: list[str] = []
        self.finished: list[str] = []

    def add_requests(self, requests: list[NewRequest]) -> list[AsyncIterator[RequestOutput]]:
        if self.refuse is not None:
            raise self.refuse
        return [self._generate(r.prompt, r.request_id) for r in requests]

    async def _generate(self, prompt: list[int], request_id: str) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            for i, piece in enumerate(self.pieces):  # one token a step, as output deltas
                await asyncio.sleep(0)
                if self.fail_after is not None and i == self.fail_after:
                    done = True
                    raise RequestFailedError("step failed")
                lps = [{i: Logprob(-0.5, 1, piece), i + 100: Logprob(-1.5, 2, "x")}]
                last = done = i == len(self.pieces) - 1
                if last:
                    self.finished.append(request_id)
                yield RequestOutput(request_id, None, prompt, [CompletionOutput(
                    0, piece, [i], logprobs=lps if self.logprobs else None,
                    finish_reason="length" if last else None)], last)
        finally:
            if not done:
                self.aborted.append(request_id)


def servers(llm: StubLLM) -> tuple[OpenAIServingChat, OpenAIServingCompletion]:
    metrics = ServerMetrics(lambda: None)
    metrics.bind("m")
    info = ModelInfo(served_names=["m"], max_model_len=1000)
    return OpenAIServingChat(llm, info, metrics), OpenAIServingCompletion(llm, info, metrics)


async def drive(response: SSEResponse, disconnect_after: int | None = None) -> tuple[list[dict], bytes]:
    """Runs the response as uvicorn would; the client leaves after `disconnect_after` body messages."""
    sent: list[dict] = []
    gone = asyncio.Event()

    async def send(message: dict) -> None:
        sent.append(message)
        if disconnect_after is not None and len(sent) > disconnect_after:
            gone.set()

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    await response({"type": "http"}, receive, send)
    return sent, b"".join(m.get("body", b"") for m in sent[1:])


def events(body: bytes) -> list[str]:
    assert body.endswith(b"\n\n")
    return [e.removeprefix("data: ") for e in body.decode().split("\n\n")[:-1]]


@pytest.mark.parametrize("text", TRICKY)
@pytest.mark.parametrize("include_usage", [False, True])
def test_text_chunk_is_pydantics_rendering(text: str, include_usage: bool) -> None:
    exclude = None if include_usage else {"usage"}
    for index in (0, 3):
        def chat(t: str, index: int = index) -> bytes:
            body = ChatCompletionChunk(id="chatcmpl-1", created=7, model='m "q" é',
                                       choices=[ChatStreamChoice(index=index, delta={"content": t})])
            return b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n"

        def completion(t: str, index: int = index) -> bytes:
            body = CompletionResponse(id="cmpl-1", created=7, model="m",
                                      choices=[CompletionChoice(index=index, text=t)])
            return b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n"

        for render in (chat, completion):
            assert TextChunk(render)(text) == render(text)  # byte for byte, so equal after json.loads too
            assert json.loads(TextChunk(render)(text)[6:]) == json.loads(render(text)[6:])


def test_text_chunk_needs_the_text_once() -> None:
    with pytest.raises(ValueError):
        TextChunk(lambda text: b"data: {}\n\n")
    with pytest.raises(ValueError):
        TextChunk(lambda text: f"data: {json.dumps([text, text])}\n\n".encode())


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_bytes_are_pydantics(include_usage: bool) -> None:
    llm = StubLLM(TRICKY[:-1])
    chat, _ = servers(llm)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                                    stream_options={"include_usage": include_usage})
    sent, body = asyncio.run(_run(chat.create(request, None)))
    assert sent[0]["headers"] == [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                                  (b"content-type", b"text/event-stream; charset=utf-8")]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    got = events(body)
    first = json.loads(got[0])
    exclude = None if include_usage else {"usage"}

    def chunk(choice: ChatStreamChoice | None, **extra) -> str:
        return ChatCompletionChunk(id=first["id"], created=first["created"], model="m",
                                   choices=[choice] if choice else [], **extra).model_dump_json(exclude=exclude)

    expected = [chunk(ChatStreamChoice(index=0, delta={"role": "assistant", "content": ""}))]
    expected += [chunk(ChatStreamChoice(index=0, delta={"content": t})) for t in TRICKY[:-1]]
    expected.append(chunk(ChatStreamChoice(index=0, delta={}, finish_reason="length")))
    if include_usage:
        expected.append(chunk(None, usage={"prompt_tokens": 3, "completion_tokens": len(TRICKY) - 1,
                                           "total_tokens": len(TRICKY) + 2,
                                           "prompt_tokens_details": {"cached_tokens": 0}}))
    assert got == expected + ["[DONE]"]
    assert llm.finished == [f"{first['id']}-0"] and llm.aborted == []


def test_completion_stream_bytes_are_pydantics() -> None:
    llm = StubLLM(["a", "", '"b"\n', "ü"])  # an empty delta sends nothing
    _, completion = servers(llm)
    sent, body = asyncio.run(_run(completion.create(CompletionRequest(prompt="hi", stream=True), None)))
    got = events(body)
    rid, created = json.loads(got[0])["id"], json.loads(got[0])["created"]

    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(index=0, text=text, finish_reason=finish_reason)
        return CompletionResponse(id=rid, created=created, model="m", choices=[choice]).model_dump_json(
            exclude={"usage"})

    assert got == [chunk("a"), chunk('"b"\n'), chunk("ü", "length"), "[DONE]"]


def test_several_choices_and_logprobs_keep_their_chunks() -> None:
    llm = StubLLM(["x", "y"], logprobs=True)
    chat, completion = servers(llm)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, n=2, logprobs=True,
                                    top_logprobs=1)
    got = [json.loads(e) for e in events(asyncio.run(_run(chat.create(request, None)))[1])[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in got if c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == "xy"
        assert [t["token"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"]] == ["x", "y"]
        assert [t["bytes"] for c in mine if c["logprobs"] for t in c["logprobs"]["content"]] == [[120], [121]]
        assert mine[-1]["finish_reason"] == "length"
    request = CompletionRequest(prompt="hi", stream=True, logprobs=1, echo=False)
    got = [json.loads(e) for e in events(asyncio.run(_run(completion.create(request, None)))[1])[:-1]]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in got] == [["x"], ["y"]]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in got] == [[0], [1]]


@pytest.mark.parametrize("n", [1, 2])
def test_refused_request_is_an_http_status(n: int) -> None:
    chat, _ = servers(StubLLM(["x"], refuse=QueueFullError("full")))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, n=n)
    with pytest.raises(APIError) as e:
        asyncio.run(chat.create(request, None))
    assert e.value.status == 429


@pytest.mark.parametrize("n", [1, 2])
def test_failure_mid_stream_goes_in_band(n: int) -> None:
    llm = StubLLM(["a", "b", "c"], fail_after=2)
    _, completion = servers(llm)
    got = events(asyncio.run(_run(completion.create(CompletionRequest(prompt="hi", stream=True, n=n), None)))[1])
    assert json.loads(got[-2])["error"]["code"] == "request_failed" and got[-1] == "[DONE]"
    texts = [json.loads(e)["choices"][0] for e in got[:-2]]
    assert ["".join(c["text"] for c in texts if c["index"] == i) for i in range(n)] == ["ab"] * n


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_aborts_the_engine_requests_at_once(n: int) -> None:
    llm = StubLLM(["tok"] * 1000)
    _, completion = servers(llm)

    async def main() -> None:
        response = await completion.create(CompletionRequest(prompt="hi", stream=True, n=n), None)
        sent, _ = await drive(response, disconnect_after=3)
        assert len(sent) < 20 and sent[-1].get("more_body") is True  # stopped early, no end of stream
        assert len(llm.aborted) == n  # before the response returned, not when its generator is collected

    asyncio.run(main())
    assert llm.finished == []


async def _run(create) -> tuple[list[dict], bytes]:
    return await drive(await create)
