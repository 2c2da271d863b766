"""POST /v1/responses: OpenAI's Responses API (what openai-agents' default model and langchain's
`use_responses_api=True` call), on the chat completions path.

A request's items become a chat: `instructions` a system message, messages (text parts), `function_call` items the
assistant's tool calls, `function_call_output` items tool results; function tools, `tool_choice` and `text.format`
map to their chat parameters. The answer is written back as output items (a message with `output_text`, and one
`function_call` per call), whole or as the Responses stream's typed events. Responses are kept in a bounded store,
so `previous_response_id` continues a conversation and `GET /v1/responses/{id}` reads one back. What the API has
and a local model cannot honour (hosted tools, reasoning effort, background runs, image parts) is refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.responses import Response

from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, ResponsesRequest
from llmserve.server.serving_chat import OpenAIServingChat
from llmserve.server.serving_engine import primed
from llmserve.server.sse import SSEResponse, unless_disconnected

MAX_STORED_RESPONSES = 1024  # the oldest are forgotten first; a later previous_response_id to one is a 404
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class _Stored:
    body: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # its chat messages, instructions left out (they are not carried over)


class ResponseStore:
    """Responses by id, the newest MAX_STORED_RESPONSES of them."""

    def __init__(self, size: int = MAX_STORED_RESPONSES) -> None:
        self.size = size
        self._items: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, response_id: str, stored: _Stored) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> _Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response has the id {response_id!r}", param=param, code="not_found")
        return stored


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    async def create(self, request: ResponsesRequest, raw: Request) -> Response:
        _check_unsupported(request)
        previous = self.store.get(request.previous_response_id, "previous_response_id").conversation \
            if request.previous_response_id else []
        conversation = previous + _input_messages(request.input)
        run = await self.chat.start(_chat_request(request, conversation))
        draft = _Draft(request, f"resp_{uuid.uuid4().hex}", int(time.time()), run.model, conversation)
        if request.stream:
            events = await primed(self.chat.stream(run))  # admission errors are still an HTTP status here
            return SSEResponse(self._events(draft, events))
        answer = await unless_disconnected(raw, self.chat.complete(run))
        if isinstance(answer, Response):  # the client left
            return answer
        choice = answer.choices[0]
        if choice.message.content:
            draft.text = choice.message.content
            draft.open_message()
        for call in choice.message.tool_calls:
            draft.add_call(call.id, call.function.name, call.function.arguments)
        draft.finish(choice.finish_reason, answer.usage.model_dump() if answer.usage else None)
        return JSONResponse(self._keep(draft))

    def get(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).body

    def _keep(self, draft: _Draft) -> dict[str, Any]:
        body = draft.body()
        if draft.request.store:
            self.store.put(draft.response_id, _Stored(body, draft.conversation + draft.assistant_messages()))
        return body

    async def _events(self, draft: _Draft, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """The chat stream's chunks as the Responses API's events: created, then per output item its added
        event, its deltas and its done events, then completed (or incomplete, or failed)."""
        writer = _EventWriter()
        yield writer("response.created", response=draft.body("in_progress"))
        yield writer("response.in_progress", response=draft.body("in_progress"))
        message: int | None = None  # output index of the message item while it is open
        calls: dict[int, int] = {}  # the chat's tool-call index -> output index
        usage: dict[str, Any] | None = None
        finish_reason: str | None = None
        try:
            async for event in _chat_events(chunks):
                if "error" in event:
                    draft.error = event["error"]
                    yield writer("response.failed", response=draft.body("failed"))
                    return
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if delta.get("content"):
                        if message is None:
                            message = draft.open_message()
                            yield writer("response.output_item.added", output_index=message,
                                         item=draft.message_item("in_progress"))
                            yield writer("response.content_part.added", item_id=draft.message_id, output_index=message,
                                         content_index=0, part=_text_part(""))
                        draft.text += delta["content"]
                        yield writer("response.output_text.delta", item_id=draft.message_id, output_index=message,
                                     content_index=0, delta=delta["content"], logprobs=[])
                    for piece in delta.get("tool_calls") or ():
                        function = piece.get("function") or {}
                        if piece["index"] not in calls:
                            for done in self._close_message(writer, draft, message):
                                yield done
                            message = None
                            calls[piece["index"]] = draft.add_call(piece["id"], function["name"], "")
                            yield writer("response.output_item.added", output_index=calls[piece["index"]],
                                         item=draft.call_item(calls[piece["index"]], "in_progress"))
                        index = calls[piece["index"]]
                        if function.get("arguments"):
                            draft.output[index]["arguments"] += function["arguments"]
                            yield writer("response.function_call_arguments.delta", item_id=draft.output[index]["id"],
                                         output_index=index, delta=function["arguments"])
        finally:
            await chunks.aclose()  # a client that left: the chat stream aborts its engine request now
        for done in self._close_message(writer, draft, message):
            yield done
        for index in calls.values():
            item = draft.call_item(index, "completed")
            yield writer("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         arguments=item["arguments"])
            yield writer("response.output_item.done", output_index=index, item=item)
        draft.finish(finish_reason, usage)
        body = self._keep(draft)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield writer(kind, response=body)

    @staticmethod
    def _close_message(writer: _EventWriter, draft: _Draft, message: int | None) -> list[bytes]:
        if message is None:
            return []
        return [writer("response.output_text.done", item_id=draft.message_id, output_index=message, content_index=0,
                       text=draft.text, logprobs=[]),
                writer("response.content_part.done", item_id=draft.message_id, output_index=message, content_index=0,
                       part=_text_part(draft.text)),
                writer("response.output_item.done", output_index=message, item=draft.message_item("completed"))]


@dataclass
class _Draft:
    """A response being built: its output items and, once finished, its status and usage."""

    request: ResponsesRequest
    response_id: str
    created_at: int
    model: str
    conversation: list[dict[str, Any]]
    output: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    message_index: int | None = None
    status: str = "in_progress"
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def open_message(self) -> int:
        self.message_index = len(self.output)
        self.output.append(self.message_item("in_progress"))
        return self.message_index

    def message_item(self, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [_text_part(self.text)]}

    def add_call(self, call_id: str, name: str, arguments: str) -> int:
        self.output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
                            "arguments": arguments, "status": "in_progress"})
        return len(self.output) - 1

    def call_item(self, index: int, status: str) -> dict[str, Any]:
        self.output[index]["status"] = status
        return dict(self.output[index])

    def finish(self, finish_reason: str | None, usage: dict[str, Any] | None) -> None:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        if self.message_index is not None:
            self.output[self.message_index] = self.message_item(self.status)
        for item in self.output:
            if item["type"] == "function_call":
                item["status"] = "completed"
        self.usage = usage

    def assistant_messages(self) -> list[dict[str, Any]]:
        """This response's output as the chat messages a continuation carries."""
        calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
                 for o in self.output if o["type"] == "function_call"]
        return [{"role": "assistant", "content": self.text or None, **({"tool_calls": calls} if calls else {})}]

    def body(self, status: str | None = None) -> dict[str, Any]:
        r = self.request
        status = status or self.status
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": [] if status == "in_progress" else self.output,
            "instructions": r.instructions, "previous_response_id": r.previous_response_id,
            "tools": r.tools or [], "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": r.parallel_tool_calls,
            "text": r.text or {"format": {"type": "text"}}, "temperature": r.temperature, "top_p": r.top_p,
            "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {}, "store": r.store,
            "truncation": r.truncation or "disabled", "user": r.user,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": self.error, "usage": _usage(self.usage) if status in ("completed", "incomplete") else None,
        }


class _EventWriter:
    """One SSE event of the Responses stream: its type as the SSE event name and in the data, numbered."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def _chat_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's events as objects, up to [DONE] (one bytes item of the stream may hold several)."""
    async for chunk in chunks:
        for line in chunk.split(b"\n\n"):
            if line.startswith(b"data: [DONE]"):
                return
            if line.startswith(b"data: "):
                yield orjson.loads(line[6:])


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _check_unsupported(request: ResponsesRequest) -> None:
    if request.background:
        raise APIError(400, "background responses are not served", param="background")
    if request.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not served: a conversation longer than the context is a 400",
                       param="truncation")
    if request.reasoning and request.reasoning.get("effort") is not None:
        raise APIError(400, "reasoning.effort: the served model does not reason", param="reasoning")
    if request.include:
        raise APIError(400, f"include: {', '.join(request.include)} cannot be included here", param="include")


def _input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input items as chat messages: consecutive function calls join one assistant message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role: {role!r} is not a message role", param=f"input[{i}].role")
            out.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", i), "type": "function",
                    "function": {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                        "content": output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)})
        else:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not served (messages, function_call and "
                           "function_call_output are)", param=f"input[{i}]")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    raise APIError(400, f"input[{i}].content: only text is served (input_text parts)", param=f"input[{i}].content")


def _field(item: dict[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{name}: required, a string", param=f"input[{i}].{name}")
    return value


def _chat_request(request: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request stands for."""
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "max_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls, "seed": request.seed, "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None, "user": request.user,
    }
    for name in ("temperature", "top_p"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(request.tools)]
    if request.tool_choice is not None:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    if request.text and request.text.get("format"):
        body["response_format"] = _format(request.text["format"])
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise APIError(400, f"{where}: {error['msg']}", param=where) from None


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}]: only function tools are served, not {tool.get('type')!r}",
                       param=f"tools[{i}]")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice: {choice!r} names no function tool", param="tool_choice")


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return {"type": fmt.get("type")}
