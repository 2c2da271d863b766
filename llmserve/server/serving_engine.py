"""What chat and completions share: checks, sampling parameters, fan-out to the engine, disconnects.

One API request becomes one engine request per choice (prompts × n). `ChoiceStreams` admits them
all before the first response byte, so a refusal (bad value, full queue) is an HTTP status rather
than an error inside a 200 stream, and merges their outputs into one stream; closing it aborts
every engine request still running, which frees their KV blocks before the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from llmserve.engine.async_engine import (
    AsyncLLM,
    ConstraintFailedError,
    EngineDeadError,
    NeverAdmittedError,
    NewRequest,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from llmserve.engine.input_processor import ContextLengthError
from llmserve.outputs import Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import APIError, bad_value
from llmserve.server.kv_transfer import KVTransfer
from llmserve.server.metrics import ServerMetrics
from llmserve.server.protocol import KVTransferParams, PromptTokensDetails, UsageInfo, _SamplingRequest
from llmserve.server.sse import SSE_DONE
from llmserve.structured_output import GrammarError
from llmserve.structured_output.manager import COMPILE_BUDGET_S

logger = logging.getLogger(__name__)

ADMITTED = b""  # the first item of an SSE generator: every engine request was accepted (see `primed`)
RETRY_AFTER_S = "1"  # what a 429 tells the client to wait; the queue drains at engine speed


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that every request is checked against."""

    served_names: list[str]
    max_model_len: int
    max_tokens_default: int | None = None  # output cap of a request without max_tokens; None: the context's end


@dataclass(frozen=True)
class Choice:
    """One engine request: a choice index in the response, its prompt's token ids and its parameters."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class OpenAIServing:
    """Base of the chat and completion handlers: request checks and the engine round trip."""

    def __init__(self, llm: AsyncLLM, info: ModelInfo, metrics: ServerMetrics, kv: KVTransfer | None = None) -> None:
        self.llm = llm
        self.info = info
        self.metrics = metrics
        self.kv = kv  # this server's half of disaggregated prefill/decode; None: a request's kv_transfer_params ignored

    def check_model(self, model: str | None) -> str:
        return check_model(self.info, model)

    def check_unsupported(self, request: _SamplingRequest) -> None:
        if (refused := request.unsupported()) is not None:
            raise APIError(400, refused[1], param=refused[0])

    def max_tokens(self, requested: int | None, prompt_len: int, prompt_param: str) -> int:
        """The output budget of one prompt (the engine's rule, with the server's default cap); 400 naming
        the limit when the prompt leaves no room for it."""
        try:
            return self.llm.processor.output_budget(prompt_len, requested, self.info.max_tokens_default,
                                                    prompt_param)
        except ContextLengthError as e:
            raise bad_value(e) from None

    async def constraint(self, request: _SamplingRequest,
                         tools: tuple[str, StructuredOutputsParams] | None = None) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, from whichever spelling it used (response_format,
        structured_outputs or guided_*; at most one, besides the (parameter, grammar) of its tool calls, which
        holds or overrides its response_format), compiled now, off the engine's lock: an invalid or unsupported
        one is a 400 with the reason, before any work is queued."""
        found = _constraints(request)
        if tools is not None:
            found = [item for item in found if item[0] != "response_format"] + [tools]
        if len(found) > 1:
            raise APIError(400, f"{' and '.join(name for name, _ in found)} each constrain the output: give one",
                           param=found[1][0])
        if not found:
            return None
        param, spec = found[0]
        manager = self.llm.structured_outputs
        await asyncio.wrap_future(manager.index())  # built once, at start: not a cost of this constraint
        try:
            await asyncio.wait_for(asyncio.wrap_future(manager.submit(spec)), COMPILE_BUDGET_S)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        except TimeoutError:
            raise APIError(400, f"{param}: the constraint took longer than {COMPILE_BUDGET_S:g} s to compile; "
                           "simplify it", param=param) from None
        return spec

    def sampling_params(self, request: _SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """Parameters for choice 0; `for_choice` derives the others. Engine range checks → 400."""
        try:
            return SamplingParams(
                temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
                seed=request.seed, presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
                max_tokens=max_tokens, min_tokens=request.min_tokens, stop=request.stop,
                stop_token_ids=request.stop_token_ids or [], ignore_eos=request.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs, logit_bias=_token_bias(request.logit_bias),
            )
        except ValueError as e:
            raise bad_value(e) from None

    def choices(
        self, prompts: list[list[int]], params: list[SamplingParams], n: int, cache_salt: str | None = None
    ) -> list[Choice]:
        """prompts × n engine requests; choice i of a seeded request samples with seed + i."""
        out = []
        for p, (ids, base) in enumerate(zip(prompts, params, strict=True)):
            for i in range(n):
                out.append(Choice(p * n + i, p, ids, base.for_choice(i), cache_salt))
        return out

    def streams(self, request_id: str, choices: list[Choice], transfer: KVTransferParams | None = None
                ) -> ChoiceStreams:
        """The choices' engine requests, their prompts' KV first pulled from a prefill instance where `transfer`
        says so (400 for what this server's role does not do)."""
        source = self.kv.check(transfer) if self.kv is not None else None
        pull = None
        if source is not None:
            kv, prompts, salt = self.kv, [c.prompt_ids for c in choices], choices[0].cache_salt

            async def pull() -> None:
                await kv.pull(source, prompts, salt)
        return ChoiceStreams(self.llm, self.metrics, request_id, choices, pull)


def check_model(info: ModelInfo, model: str | None) -> str:
    """The served name to answer with; 404 for a model this server does not serve."""
    if model is None:
        return info.served_names[0]
    if model not in info.served_names:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in info.served_names)}", param="model", code="model_not_found")
    return model


def response_format_schema(request: _SamplingRequest) -> dict[str, Any] | None:
    """The JSON schema a response_format asks the answer to follow (None for plain text); 400 for a json_schema
    format without its schema."""
    rf = request.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "object"}
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(400, "response_format: json_schema.schema is required for type 'json_schema'",
                       param="response_format")
    return rf.json_schema.schema_


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as JSON object keys (text): back to ints."""
    if not bias:
        return None
    bad = next((key for key in bias if not key.isascii() or not key.isdigit()), None)
    if bad is not None:
        raise ValueError(f"logit_bias must map token ids (integers, as text) to biases, got the key {bad!r}")
    return {int(key): value for key, value in bias.items()}


def _constraints(request: _SamplingRequest) -> list[tuple[str, StructuredOutputsParams]]:
    """(parameter name, constraint) for each constraining parameter the request set."""
    found: list[tuple[str, dict]] = []
    schema = response_format_schema(request)
    if schema is not None:
        json_mode = request.response_format.type == "json_object"
        found.append(("response_format", {"json_object": True} if json_mode else {"json": schema}))
    so = request.structured_outputs
    if so is not None:
        found.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                             "grammar": so.grammar, "json_object": bool(so.json_object)}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(request, name) is not None:
            found.append((name, {key: getattr(request, name)}))
    out = []
    for name, fields in found:
        try:
            out.append((name, StructuredOutputsParams(**fields)))
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None
    return out


def usage(choices: list[Choice], finals: dict[int, RequestOutput], completion_tokens: int | None = None
          ) -> UsageInfo:
    """Prompt tokens once per prompt (not per choice), completion tokens summed over choices: those of
    `finals` (whole outputs), or `completion_tokens` where a stream counted them delta by delta."""
    prompt_tokens = cached = 0
    seen: set[int] = set()
    for choice in choices:
        if choice.prompt_index in seen:
            continue
        seen.add(choice.prompt_index)
        prompt_tokens += len(choice.prompt_ids)
        if choice.index in finals:
            cached += finals[choice.index].num_cached_tokens
    completion = completion_tokens if completion_tokens is not None else \
        sum(len(out.outputs[0].token_ids) for out in finals.values())
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position, best first (the chosen one included where it ranks)."""
    ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank)[:k]


def engine_error(e: BaseException) -> APIError:
    """The HTTP answer to an exception from `AsyncLLM.generate`."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, NeverAdmittedError):
        return APIError(400, str(e), param="n", code="too_many_sequences")
    if isinstance(e, ValueError):
        return bad_value(e)
    if isinstance(e, QueueFullError):
        return APIError(429, f"the server is busy ({e}); retry later", code="queue_full",
                        headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", code="engine_dead")
    if isinstance(e, ConstraintFailedError):
        return APIError(400, str(e), code="constraint_failed")
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the request failed in the engine: {e}", code="request_failed")
    logger.error("request failed", exc_info=e)
    return APIError(500, f"internal server error ({type(e).__name__})")


class ChoiceStreams:
    """The engine requests of one API request, admitted together and merged into one output stream.

    Use as `async with streams: async for index, out in streams.outputs(): ...`. Entering admits every
    choice or none (a refusal raises `APIError` before any response byte); leaving the block (finished,
    failed, or cancelled by a disconnect) aborts whatever still runs.

    A single choice (n=1, one prompt: nearly every request) is read straight from the engine's stream
    in the consumer's task; several are merged by one pump task per choice into a queue. The pump and
    queue cost a task switch per token, a visible share of the event loop's CPU per streamed token.
    """

    def __init__(self, llm: AsyncLLM, metrics: ServerMetrics, request_id: str, choices: list[Choice],
                 before: Callable[[], Awaitable[None]] | None = None) -> None:
        """`before`: awaited before the choices are admitted (a KV pull)."""
        self._before = before
        self._llm = llm
        self._metrics = metrics
        self._request_id = request_id
        self._choices = choices
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._pending = {c.index for c in choices}
        self._streams: list[RequestStream] = []
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> ChoiceStreams:
        if self._before is not None:
            await self._before()
        try:
            self._streams = self._llm.add_requests([
                NewRequest(c.prompt_ids, c.params, f"{self._request_id}-{c.index}", c.cache_salt)
                for c in self._choices
            ])
        except Exception as e:
            raise engine_error(e) from None
        if len(self._streams) > 1:
            self._tasks = [asyncio.create_task(self._pump(c, stream))
                           for c, stream in zip(self._choices, self._streams, strict=True)]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output delta) as they arrive; engine failures raise `APIError`.

        Several choices: deltas that queued up while the caller was busy are folded together per choice:
        a slow client gets fewer, larger chunks.
        """
        return self._lone() if len(self._streams) == 1 else self._merged()

    async def collect(self) -> dict[int, RequestOutput]:
        """The whole output of every choice, its deltas folded together."""
        finals: dict[int, RequestOutput] = {}
        async for index, out in self.outputs():
            if index in finals:
                finals[index].add(out)
            else:
                finals[index] = out
        return finals

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()  # aborts the engine request if it still runs

    async def _lone(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        index = self._choices[0].index
        tracker = self._metrics.track()
        try:
            async for out in self._streams[0]:
                tracker.observe(out)
                yield index, out
        except Exception as e:  # from the engine, as the pumps' consumer below answers it
            self._count_failure(e)
            raise engine_error(e) from None

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._pending:
            item = await self._queue.get()
            batch: dict[int, RequestOutput] = {}
            while True:
                index, out = item
                if isinstance(out, BaseException):
                    raise engine_error(out)
                if index in batch:
                    batch[index].add(out)
                else:
                    batch[index] = out
                if out.finished:
                    self._pending.discard(index)
                if self._queue.empty():
                    break
                item = self._queue.get_nowait()
            for index in sorted(batch):
                yield index, batch[index]

    async def _pump(self, choice: Choice, stream: RequestStream) -> None:
        tracker = self._metrics.track()
        try:
            async for out in stream:
                tracker.observe(out)
                self._queue.put_nowait((choice.index, out))
        except Exception as e:  # handed to the consumer, which answers with the matching status
            self._count_failure(e)
            self._queue.put_nowait((choice.index, e))

    def _count_failure(self, e: Exception) -> None:
        if isinstance(e, RequestFailedError):
            self._metrics.failure("constraint" if isinstance(e, ConstraintFailedError) else "engine")


class TextChunk:
    """One choice's plain text chunk (no logprobs, not the last) as SSE bytes, from a template.

    Why: the event loop shares the cores with the model, and pydantic builds two models and serialises
    them for every chunk, slower still on a core the model also uses. Within a request only the text
    changes, so pydantic renders the chunk once around a placeholder and each token's text is escaped
    into it by the C JSON encoder, which writes strings as pydantic does (UTF-8, not \\u escapes): a
    fraction of the cost, the same bytes (docs/performance.md, "Served against llama.cpp and vLLM-CPU").
    """

    __slots__ = ("_head", "_tail")

    def __init__(self, render: Callable[[str], bytes]) -> None:
        """`render(text)`: the pydantic rendering of this choice's chunk carrying `text`."""
        head, placeholder, tail = render(_PLACEHOLDER).decode().partition(_json_string(_PLACEHOLDER))
        if not placeholder or _json_string(_PLACEHOLDER) in tail:
            raise ValueError("the rendered chunk must hold the text exactly once")
        self._head, self._tail = head, tail

    def __call__(self, text: str) -> bytes:
        return (self._head + _json_string(text) + self._tail).encode()


_json_string = json.JSONEncoder(ensure_ascii=False).encode  # a str as a JSON string literal
_PLACEHOLDER = "\x00text\x00"  # marks where the text goes in a template (NULs: in no id or model name)


async def sse_events(
    streams: ChoiceStreams,
    request_id: str,
    intro: Iterable[bytes],
    render: Callable[[int, RequestOutput], bytes],
    usage_event: Callable[[dict[int, RequestOutput], int], bytes] | None,
) -> AsyncGenerator[bytes, None]:
    """The SSE life of one API request, whatever the endpoint: admission (a refusal raises before the 200
    goes out), ADMITTED, the endpoint's intro events, `render(choice index, output delta)` for every
    engine output in order (b"": nothing to send), the usage event if asked for, [DONE]. A failure after the
    headers goes in-band and ends this stream alone; a disconnect aborts the choices still running."""
    finals: dict[int, RequestOutput] = {}  # each choice's last delta
    generated = 0  # tokens, over every choice's deltas
    await streams.__aenter__()
    try:
        try:
            yield ADMITTED
            head = b"".join(intro)
            if head:
                yield head
            async for index, out in streams.outputs():
                generated += len(out.outputs[0].token_ids)
                if out.finished:
                    finals[index] = out
                event = render(index, out)
                if event:
                    yield event
        finally:
            await streams.aclose()  # a no-op when all finished; aborts the rest on disconnect
        if usage_event is not None:
            yield usage_event(finals, generated)
    except APIError as e:
        yield e.sse_event()
    except Exception as e:
        logger.exception("stream %s failed", request_id)
        yield APIError(500, f"internal server error ({type(e).__name__})").sse_event()
    yield SSE_DONE


async def primed(events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """Runs an SSE generator up to its first item, `ADMITTED`, now: admission errors raise here, as an
    HTTP status, not inside a stream whose 200 already went out; the 200 can go out at once, even
    for a request that waits in the queue. Then streams the rest."""
    first = await anext(events)
    assert first == ADMITTED, "an SSE generator must yield ADMITTED once its requests are queued"
    return events
