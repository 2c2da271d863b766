"""POST /v1/chat/completions: messages through the model's chat template, answered whole or as SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.responses import Response

from llmserve.engine.detokenizer import TokenBytes
from llmserve.outputs import Logprob, RequestOutput
from llmserve.server.errors import APIError
from llmserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    Tool,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from llmserve.server.serving_engine import (
    Choice,
    ChoiceStreams,
    OpenAIServing,
    TextChunk,
    new_request_id,
    primed,
    sse_events,
    top_logprobs,
    usage,
)
from llmserve.server.sse import SSEResponse, unless_disconnected
from llmserve.server.tool_calls import ToolCallParser, active_tools, chat_messages, tool_call_constraint


@dataclass
class ChatRun:
    """One chat request checked, rendered and admitted-to-be: what answering it whole or streamed needs."""

    request: ChatCompletionRequest
    streams: ChoiceStreams
    choices: list[Choice]
    request_id: str
    model: str
    num_logprobs: int | None
    tool_names: set[str]  # calls are parsed out of the text where tools are offered
    enforced: bool  # a grammar makes the calls (their arguments may stream in pieces)


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        run = await self.start(request)
        if request.stream:
            return SSEResponse(await primed(self.stream(run)))
        return await unless_disconnected(raw, self._json(run))

    async def start(self, request: ChatCompletionRequest) -> ChatRun:
        """Check and render a request (400s here, before anything is queued). The Responses API answers through
        this too."""
        model = self.check_model(request.model)
        self.check_unsupported(request)
        tools = active_tools(request)
        prompt_ids = self._render(request, tools)
        num_logprobs = self._num_logprobs(request)
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = self.max_tokens(requested, len(prompt_ids), "messages")
        tool_grammar = tool_call_constraint(request, tools)
        param = "response_format" if request.tool_choice in (None, "auto") else "tool_choice"
        constraint = await self.constraint(request, (param, tool_grammar) if tool_grammar is not None else None)
        params = self.sampling_params(request, max_tokens, num_logprobs, structured_outputs=constraint)
        choices = self.choices([prompt_ids], [params], request.n, request.cache_salt)
        request_id = new_request_id("chatcmpl")
        streams = self.streams(request_id, choices, request.kv_transfer_params)
        return ChatRun(request, streams, choices, request_id, model, num_logprobs,
                       {t.function.name for t in tools}, tool_grammar is not None)

    # --- request → prompt ---------------------------------------------------------------------

    def _render(self, request: ChatCompletionRequest, tools: list[Tool]) -> list[int]:
        texts = []
        for i, m in enumerate(request.messages):
            if isinstance(m.content, list):
                if any(part.type != "text" or part.text is None for part in m.content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                texts.append("\n".join(part.text for part in m.content))
            else:
                texts.append(m.content or "")
        processor = self.llm.processor
        messages = chat_messages(request.messages, texts, tools, processor.template_renders_tools)
        tool_objects = [t.model_dump(exclude_none=True) for t in tools] if processor.template_renders_tools else None
        try:
            return processor.encode_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                         tools=tool_objects)
        except (ValueError, TemplateError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    @staticmethod
    def _num_logprobs(request: ChatCompletionRequest) -> int | None:
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None

    # --- non-streaming ------------------------------------------------------------------------

    async def complete(self, run: ChatRun) -> ChatCompletionResponse:
        """The whole answer."""
        async with run.streams:
            finals = await run.streams.collect()
        response = ChatCompletionResponse(id=run.request_id, model=run.model, usage=usage(run.choices, finals),
                                          choices=[])
        for i in sorted(finals):
            completion = finals[i].outputs[0]
            content, calls = ToolCallParser(run.tool_names).parse(completion.text) if run.tool_names else \
                (completion.text, [])
            response.choices.append(ChatCompletionChoice(
                index=i,
                message=ChatResponseMessage(content=content, tool_calls=calls),
                logprobs=_logprobs(finals[i], run.num_logprobs, self.llm.token_bytes),
                finish_reason=_finish_reason(completion.finish_reason, bool(calls)),
            ))
        return response

    async def _json(self, run: ChatRun) -> JSONResponse:
        return JSONResponse((await self.complete(run)).model_dump())

    # --- streaming ----------------------------------------------------------------------------

    def stream(self, run: ChatRun) -> AsyncGenerator[bytes, None]:
        """SSE as OpenAI sends it: role chunk, content deltas, tool calls as `delta.tool_calls`, finish chunk,
        [usage chunk], [DONE]. A call the grammar enforces (`enforced`: tool_choice required or named, or beside a
        response_format) streams as OpenAI's do: its id and name, then its arguments in pieces as they are
        written. A free call (tool_choice auto) goes out whole once its closing tag came: until then it may
        still turn out to be text."""
        streams, choices, request, request_id, model = run.streams, run.choices, run.request, run.request_id, run.model
        num_logprobs, tool_names, enforced = run.num_logprobs, run.tool_names, run.enforced
        created = int(time.time())
        exclude = None if request.include_usage else {"usage"}

        def chunk(choice: ChatStreamChoice | None, usage_info: UsageInfo | None = None) -> bytes:
            body = ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[choice] if choice else [], usage=usage_info)
            return b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n"

        def content_chunk(index: int, text: str) -> bytes:
            return chunk(ChatStreamChoice(index=index, delta={"content": text}))

        content = {c.index: TextChunk(partial(content_chunk, c.index)) for c in choices}  # the per-token chunks
        parsers = {c.index: ToolCallParser(tool_names) for c in choices} if tool_names else {}

        streamed: dict[int, tuple[str, int]] = {}  # by choice: (id, characters of arguments sent) of a call

        def tool_calls_chunk(index: int, calls: list[ToolCall]) -> bytes:
            parser = parsers[index]
            first = parser.num_calls - len(calls)  # the choice's calls are numbered from 0, in order
            deltas: list[dict] = []
            for k, call in enumerate(calls):
                sent = streamed.pop(index, None)
                if sent is not None and sent[0] == call.id:  # its head and part of its arguments went out
                    if rest := call.function.arguments[sent[1]:]:
                        deltas.append({"index": first + k, "function": {"arguments": rest}})
                else:
                    deltas.append({"index": first + k, **call.model_dump()})
            progress = parser.in_progress() if enforced else None
            if progress is not None:
                call_id, name, arguments = progress
                sent = streamed.get(index)
                if sent is None:
                    deltas.append({"index": parser.num_calls, "id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": arguments}})
                elif len(arguments) > sent[1]:
                    deltas.append({"index": parser.num_calls, "function": {"arguments": arguments[sent[1]:]}})
                streamed[index] = (call_id, len(arguments))
            return chunk(ChatStreamChoice(index=index, delta={"tool_calls": deltas})) if deltas else b""

        def render(index: int, out: RequestOutput) -> bytes:  # out: a delta
            completion = out.outputs[0]
            delta, calls = completion.text, []
            if parsers:
                delta, calls = parsers[index].feed(delta)
                if out.finished:
                    rest, more = parsers[index].finish()
                    delta, calls = delta + rest, calls + more
            if num_logprobs is None:
                event = content[index](delta) if delta else b""
            else:
                lps = _logprobs(out, num_logprobs, self.llm.token_bytes)
                has_content = delta or lps.content
                event = chunk(ChatStreamChoice(index=index, delta={"content": delta}, logprobs=lps)) if has_content \
                    else b""
            if calls or (enforced and parsers):
                event += tool_calls_chunk(index, calls)
            if out.finished:
                reason = _finish_reason(completion.finish_reason, bool(parsers and parsers[index].num_calls))
                event += chunk(ChatStreamChoice(index=index, delta={}, finish_reason=reason))
            return event

        intro = (chunk(ChatStreamChoice(index=c.index, delta={"role": "assistant", "content": ""})) for c in choices)
        usage_event = (lambda finals, generated: chunk(None, usage(choices, finals, generated))) \
            if request.include_usage else None
        return sse_events(streams, request_id, intro, render, usage_event)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" where the model ended by calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def _logprobs(out: RequestOutput, k: int | None, token_bytes: TokenBytes) -> ChatChoiceLogprobs | None:
    """OpenAI's chat logprobs of this output's tokens, or None when they were not asked for.

    `bytes` are each token's own bytes (joined, they rebuild the text, also where a token ends inside
    a multi-byte character); `token` is its decoded text, U+FFFD for such a partial character."""
    if k is None:
        return None
    return ChatChoiceLogprobs(content=[_token_logprob(entry, k, token_bytes)
                                       for entry in out.outputs[0].logprobs or []])


def _token_logprob(entry: dict[int, Logprob], k: int, token_bytes: TokenBytes) -> ChatTokenLogprob:
    token_id, chosen = next(iter(entry.items()))  # the engine puts the sampled token first
    return ChatTokenLogprob(
        token=chosen.decoded_token or "", logprob=chosen.logprob, bytes=list(token_bytes[token_id]),
        top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob, bytes=list(token_bytes[tid]))
                      for tid, lp in top_logprobs(entry, k)],
    )
