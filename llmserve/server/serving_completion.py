"""POST /v1/completions: raw prompts (text or token ids, one or several), answered whole or as SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from llmserve.outputs import Logprob, RequestOutput
from llmserve.server.errors import APIError
from llmserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
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


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw: Request) -> Response:
        model = self.check_model(request.model)
        self.check_unsupported(request)
        prompts = self._tokenize(request.prompt)
        # echo with logprobs: the prompt's tokens are scored too (what perplexity through an API reads)
        asked = [k for k in (request.logprobs if request.echo else None, request.prompt_logprobs) if k is not None]
        prompt_logprobs = max(asked) if asked else None
        constraint = await self.constraint(request)
        params = [
            self.sampling_params(request, self.max_tokens(request.max_tokens, len(ids), "prompt"), request.logprobs,
                                 prompt_logprobs, constraint)
            for ids in prompts
        ]
        choices = self.choices(prompts, params, request.n, request.cache_salt)
        # echo: the prompt's text goes in front of each choice's text
        echoes = [self._prompt_text(request.prompt, c.prompt_index, c.prompt_ids) if request.echo else ""
                  for c in choices]
        request_id = new_request_id("cmpl")
        streams = self.streams(request_id, choices, request.kv_transfer_params)
        if request.stream:
            events = await primed(self._stream(streams, choices, echoes, request, request_id, model))
            return SSEResponse(events)
        return await unless_disconnected(raw, self._complete(streams, choices, echoes, request, request_id, model))

    # --- request → prompts --------------------------------------------------------------------

    def _tokenize(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]  # one prompt of token ids
        out = []
        for p in prompt:
            ids = self.llm.processor.encode(p) if isinstance(p, str) else list(p)
            try:  # here, not only when the engine admits them: echo decodes them first
                self.llm.processor.check_prompt_ids(ids)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
            out.append(ids)
        return out

    def _echoed_logprobs(self, out: RequestOutput, request: CompletionRequest, choice: Choice,
                         echo: str) -> CompletionLogprobs | None:
        """With echo, the prompt's tokens (the first one unscored, as OpenAI's) before the generated ones."""
        if request.logprobs is None or not request.echo:
            return _logprobs(out, request.logprobs, len(echo))
        result, offset = CompletionLogprobs(), 0
        for token_id, entry in zip(choice.prompt_ids, out.prompt_logprobs or [], strict=True):
            if entry is None:
                token = self.llm.tokenizer.decode([token_id])
                result.tokens.append(token)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                result.text_offset.append(offset)
                offset += len(token)
            else:
                offset = _append(result, entry, request.logprobs, offset)
        generated = _logprobs(out, request.logprobs, len(echo))
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(result, name).extend(getattr(generated, name))
        return result

    def _prompt_text(self, prompt: str | list, index: int, ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt[index], str):
            return prompt[index]
        return self.llm.tokenizer.decode(ids)

    # --- non-streaming ------------------------------------------------------------------------

    async def _complete(self, streams: ChoiceStreams, choices: list[Choice], echoes: list[str],
                        request: CompletionRequest, request_id: str, model: str) -> JSONResponse:
        async with streams:
            finals = await streams.collect()
        response = CompletionResponse(
            id=request_id, model=model, usage=usage(choices, finals),
            choices=[
                CompletionChoice(
                    index=i,
                    text=echoes[i] + finals[i].outputs[0].text,
                    logprobs=self._echoed_logprobs(finals[i], request, choices[i], echoes[i]),
                    finish_reason=finals[i].outputs[0].finish_reason,
                    prompt_logprobs=_prompt_logprobs(finals[i], request.prompt_logprobs),
                )
                for i in sorted(finals)
            ],
        )
        return JSONResponse(response.model_dump())

    # --- streaming ----------------------------------------------------------------------------

    def _stream(self, streams: ChoiceStreams, choices: list[Choice], echoes: list[str],
                request: CompletionRequest, request_id: str, model: str) -> AsyncGenerator[bytes, None]:
        """SSE as OpenAI sends it: text deltas, finish_reason on each choice's last chunk, [usage], [DONE]."""
        created = int(time.time())
        exclude = None if request.include_usage else {"usage"}

        def chunk(choice: CompletionChoice | None, usage_info: UsageInfo | None = None) -> bytes:
            body = CompletionResponse(id=request_id, created=created, model=model,
                                      choices=[choice] if choice else [], usage=usage_info)
            return b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n"

        def text_chunk(index: int, text: str) -> bytes:
            return chunk(CompletionChoice(index=index, text=text))

        texts = {c.index: TextChunk(partial(text_chunk, c.index)) for c in choices}  # the per-token chunks
        offsets = {c.index: len(echoes[c.index]) for c in choices}  # text_offset of the next token
        # echo with logprobs: the prompt, with its tokens' logprobs, goes out with each choice's first output
        scored_echo = request.echo and request.logprobs is not None
        pending_echo = {c.index for c in choices} if scored_echo else set()

        def render(index: int, out: RequestOutput) -> bytes:
            completion = out.outputs[0]  # a delta
            delta = completion.text
            if request.logprobs is None and not out.finished:
                return texts[index](delta) if delta else b""
            if index in pending_echo:
                pending_echo.discard(index)
                delta = echoes[index] + delta
                lps = self._echoed_logprobs(out, request, choices[index], echoes[index])
                return chunk(CompletionChoice(index=index, text=delta, logprobs=lps,
                                              finish_reason=completion.finish_reason))
            lps = _logprobs(out, request.logprobs, offsets[index])
            if lps is not None:
                offsets[index] += sum(len(t) for t in lps.tokens)
            if delta or (lps and lps.tokens) or out.finished:
                return chunk(CompletionChoice(index=index, text=delta, logprobs=lps,
                                              finish_reason=completion.finish_reason))
            return b""

        intro = (chunk(CompletionChoice(index=c.index, text=echoes[c.index])) for c in choices
                 if echoes[c.index] and not scored_echo)
        usage_event = (lambda finals, generated: chunk(None, usage(choices, finals, generated))) \
            if request.include_usage else None
        return sse_events(streams, request_id, intro, render, usage_event)


def _prompt_logprobs(out: RequestOutput, k: int | None) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: each prompt token's own entry and its k most likely, by token id (None first)."""
    if k is None:
        return None
    result: list[dict[str, PromptLogprob] | None] = []
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=True):
        if entry is None:
            result.append(None)
            continue
        chosen = {str(token_id): PromptLogprob(**vars(entry[token_id]))}
        result.append({**chosen, **{str(t): PromptLogprob(**vars(lp)) for t, lp in top_logprobs(entry, k)}})
    return result


def _logprobs(out: RequestOutput, k: int | None, offset: int) -> CompletionLogprobs | None:
    """The legacy logprobs of this output's tokens: the chosen token and the k most likely ones."""
    if k is None:
        return None
    result = CompletionLogprobs()
    for entry in out.outputs[0].logprobs or []:
        offset = _append(result, entry, k, offset)
    return result


def _append(result: CompletionLogprobs, entry: dict[int, Logprob], k: int, offset: int) -> int:
    """One token's legacy logprobs appended; returns the next token's text offset."""
    chosen = next(iter(entry.values()))  # the engine puts the sampled (or prompt) token first
    token = chosen.decoded_token or ""
    top = {lp.decoded_token or "": lp.logprob for _, lp in top_logprobs(entry, k)}
    top.setdefault(token, chosen.logprob)
    result.tokens.append(token)
    result.token_logprobs.append(chosen.logprob)
    result.top_logprobs.append(top)
    result.text_offset.append(offset)
    return offset + len(token)
