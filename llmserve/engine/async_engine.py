"""The engine behind a server: one background thread runs the step loop; each request gets an
asyncio stream of incremental outputs.

Why a thread and not a process: on a 2-core machine the model's kernels release the GIL and use
both cores, and a thread hands outputs to the event loop with no serialisation. Engine state is
guarded by one condition lock, which the step loop holds for a whole step. New requests and aborts
never wait for it: they go into an inbox (its own small lock) that the loop empties before each
step, so a burst of requests joins the next step together. (When each `add` waited for the engine
lock, the event loop stopped for up to a step per request: 32 requests arriving at once reached the
engine one to three per step, and the median first token waited ~15 steps.)

The engine thread also *loads* the model, and no other thread runs a torch kernel. OpenMP keeps one
worker team per thread that ever entered a parallel region; once the process has more OpenMP threads
than cores, libgomp stops spinning and puts workers to sleep after every region, so each small op
pays a futex wake-up, which slows a decode step badly when the model was loaded in one thread and stepped
in another (docs/performance.md, "The default configuration").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from llmserve.config import EngineConfig
from llmserve.engine.detokenizer import TokenBytes
from llmserve.engine.input_processor import InputProcessor
from llmserve.engine.llm_engine import EngineStats, LLMEngine
from llmserve.engine.model_runner import RunnerStoppedError
from llmserve.engine.request import Request
from llmserve.engine.stat_logger import StatLogger
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.structured_output import StructuredOutputManager

# how often an idle step loop checks that the engine can still step (every parallel rank alive)
HEALTH_CHECK_INTERVAL_S = 1.0

logger = logging.getLogger(__name__)

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests are unaffected."""


class ConstraintFailedError(RequestFailedError):
    """This request's output constraint failed while decoding (a limit of the grammar library reached mid-output):
    the constraint's failure, not the server's."""


class NeverAdmittedError(ValueError):
    """More sequences at once than the queue bound: this request could never be queued (HTTP 400, not 429)."""


@dataclass(frozen=True)
class NewRequest:
    """One engine request to add: what `generate` takes, for adding several at once."""

    prompt: str | list[int]
    params: SamplingParams
    request_id: str | None = None
    cache_salt: str | None = None


@dataclass
class ServingStats(EngineStats):
    """The engine's stats and what the serving loop counts: tokens admitted and generated."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, max_queued_requests: int | None = None, log_interval_s: float = 10.0,
        on_stop: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`on_stop`: called (from the engine thread) if the engine stops for good while serving, e.g. a
        parallel rank died; the server exits on it."""
        self.max_queued_requests = max_queued_requests
        self._on_stop = on_stop
        self._cond = threading.Condition()
        # Requests built on the event loop and aborts, taken by the step loop before its next step; `_wake` (never
        # held during a step) guards them and wakes an idle loop.
        self._wake = threading.Condition(threading.Lock())
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        # functions to run on the engine between two steps (`between_steps`), with where their answer goes
        self._calls: list[tuple[Callable[[LLMEngine], Any], asyncio.AbstractEventLoop, asyncio.Future]] = []
        # Callers (abort_all) waiting for the engine lock; the step loop lets them in between steps.
        self._num_callers = 0
        self._callers_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._dead: BaseException | None = None
        self._prompt_tokens = 0
        self._generation_tokens = 0
        # Blocking until the model is loaded: call from a worker thread at server start-up.
        loaded = threading.Event()
        load_error: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._load_and_loop, args=(config, log_interval_s, loaded, load_error),
            name="llmserve-engine", daemon=True,
        )
        self._thread.start()
        loaded.wait()
        if load_error:
            raise load_error[0]

    # --- facts the server needs ---------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def token_bytes(self) -> TokenBytes:
        return self.engine.token_bytes

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """Compiles constraints (thread-safe, off the engine's lock: call it from a worker thread)."""
        return self.engine.structured

    @property
    def processor(self) -> InputProcessor:
        """Tokenization and the length rule, shared with the engine (read-only: safe from any thread)."""
        return self.engine.processor

    def stats(self) -> ServingStats:
        """Read without the engine lock (counts and lengths, each read whole): a scrape never waits for a step,
        and may see one step's changes half applied."""
        stats = self.engine.stats()
        return ServingStats(**vars(stats), prompt_tokens_total=self._prompt_tokens,
                            generation_tokens_total=self._generation_tokens)

    # --- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs as tokens arrive; the last has finished=True.

        Raises ValueError (bad request, nothing queued), QueueFullError, EngineDeadError, or
        RequestFailedError mid-stream. Leaving the iteration early (a client that went away)
        aborts the request and frees its KV blocks before the next step.
        """
        [stream] = self.add_requests([NewRequest(prompt, params, request_id, cache_salt)])
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def add_requests(self, requests: list[NewRequest]) -> list[RequestStream]:
        """Admit several requests (one API request's prompts × n) all together or none of them; they join the
        engine's next step. Never waits for a step.

        Raises, with nothing queued: ValueError for a bad request, NeverAdmittedError when they are
        more than the queue holds at all, QueueFullError when the queue has no room for all of them
        now, EngineDeadError. Call from the event loop that reads the streams.
        """
        loop = asyncio.get_running_loop()
        bound = self.max_queued_requests
        if bound is not None and len(requests) > bound:
            raise NeverAdmittedError(
                f"this request needs {len(requests)} sequences (prompts × n), more than the {bound} the "
                "server queues at once (--max-queued-requests): it could never be admitted; lower n or "
                "send fewer prompts")
        ids = [r.request_id or f"req-{next(self._ids)}" for r in requests]
        if len(set(ids)) < len(ids):
            raise ValueError(f"request ids repeat: {ids}")
        built = [self.engine.new_request(request_id, r.prompt, r.params, cache_salt=r.cache_salt)
                 for request_id, r in zip(ids, requests, strict=True)]
        with self._wake:
            if self._dead is not None:
                raise EngineDeadError(f"engine stopped: {self._dead}")
            if self._stopping:
                raise EngineDeadError("server is shutting down")
            if bound is not None:
                waiting = len(self.engine.scheduler.waiting) + len(self._inbox)
                if waiting + len(requests) > bound:
                    raise QueueFullError(f"{waiting} of {bound} queue places are taken")
            for request_id in ids:
                if request_id in self._streams:
                    raise ValueError(f"request_id {request_id!r} is already in use")
            streams = []
            for req in built:
                self._prompt_tokens += req.num_prompt_tokens
                queue: asyncio.Queue = asyncio.Queue()
                self._streams[req.request_id] = (loop, queue)
                streams.append(RequestStream(self, req.request_id, queue))
            self._inbox.extend(built)
            self._wake.notify()
        return streams

    async def between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run by the step loop before its next step, and its result (or its exception): for what reads
        or changes the engine's state, such as its KV blocks, without racing a step, and on the one thread that runs
        torch kernels (see the module's docstring). Never waits for more than the step under way."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._wake:
            if self._dead is not None:
                raise EngineDeadError(f"engine stopped: {self._dead}")
            self._calls.append((fn, loop, future))
            self._wake.notify()
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends now, its blocks are freed before the next step. Never waits for a
        step."""
        with self._wake:
            self._streams.pop(request_id, None)
            queued = next((r for r in self._inbox if r.request_id == request_id), None)
            if queued is not None:  # never reached the engine
                self._inbox.remove(queued)
            else:
                self._aborts.append(request_id)
                self._wake.notify()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests, let the running ones finish (up to timeout), stop the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        self.abort_all("server shut down before the request finished")
        if hasattr(self, "engine"):
            self.engine.shutdown()
        with self._cond:
            self._dead = self._dead or EngineDeadError("shut down")

    def abort_all(self, reason: str) -> int:
        """Stop taking requests and end every open one now: each stream raises EngineDeadError(reason).
        Returns how many were open."""
        with self._turn(), self._wake:
            self._stopping = True
            self._inbox.clear()
            open_ids = list(self._streams)
            self._deliver([(r, EngineDeadError(reason)) for r in open_ids])
            for request_id in open_ids:
                self.engine.abort_request(request_id)
            self._wake.notify()
        return len(open_ids)

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """The engine lock, taken before the step loop's next step.

        A plain lock is unfair: the step loop re-takes it the moment it lets go, and a caller on
        the event loop can wait through many steps under load, stalling every HTTP request.
        Callers announce themselves; the loop waits after each step until none is left.
        """
        with self._callers_lock:
            self._num_callers += 1
        try:
            self._cond.acquire()
        finally:
            with self._callers_lock:
                self._num_callers -= 1
        try:
            yield
        finally:
            self._cond.notify_all()
            self._cond.release()

    @property
    def is_running(self) -> bool:
        """The step loop runs and the engine can step (every parallel rank alive)."""
        return self._thread.is_alive() and self.engine.healthy

    # --- the step loop ------------------------------------------------------------------------

    def _load_and_loop(
        self, config: EngineConfig, log_interval_s: float, loaded: threading.Event, load_error: list
    ) -> None:
        try:
            self.engine = LLMEngine(config)
            self._stat_logger = StatLogger(self.engine, log_interval_s)
        except BaseException as e:
            load_error.append(e)
            return
        finally:
            loaded.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._inbox or self._aborts or self._calls or self._stopping
                               or self.engine.has_unfinished_requests()):
                        self._wake.wait(HEALTH_CHECK_INTERVAL_S)
                        if not self.engine.healthy:  # idle, but a rank died: stop now, not at the next request
                            raise RunnerStoppedError("the engine's model runner stopped (a parallel rank died)")
                with self._cond:
                    # moved under both locks: a request is always in the inbox or the waiting queue, where the
                    # queue bound counts it
                    with self._wake:
                        for req in self._inbox:
                            self.engine.scheduler.add_request(req)
                        self._inbox.clear()
                        aborts, self._aborts = self._aborts, []
                        calls, self._calls = self._calls, []
                    for request_id in aborts:
                        self.engine.abort_request(request_id)
                    for fn, loop, future in calls:
                        _run_call(self.engine, fn, loop, future)
                    if self._stopping and not self.engine.has_unfinished_requests():
                        return
                    self._step()
                    while self._num_callers:  # give way to callers queued on the lock (see _turn)
                        self._cond.wait()
        except BaseException as e:  # the loop itself broke: fail every open stream, say why
            logger.exception("engine loop died")
            with self._cond, self._wake:
                self._dead = e
                self._inbox.clear()
                for _, loop, future in self._calls:
                    loop.call_soon_threadsafe(_settle, future, None, EngineDeadError(f"engine stopped: {e}"))
                self._calls.clear()
                self._deliver([(r, EngineDeadError(f"engine stopped: {e}")) for r in list(self._streams)])
            self.engine.shutdown()
            if self._on_stop is not None:
                self._on_stop(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RunnerStoppedError:  # no step can run again: the loop ends
            raise
        except Exception as e:  # a failed forward pass fails the requests it carried, not the server
            logger.exception("engine step failed; failing its requests")
            failed = list(self.engine.requests)
            for request_id in failed:
                self.engine.abort_request(request_id)
            self._deliver([(r, RequestFailedError(f"engine step failed: {e}")) for r in failed])
            return
        self._deliver([
            (out.request_id, _failure(out) if out.error else out) for out in outputs
        ])
        self._generation_tokens += sum(len(out.outputs[0].token_ids) for out in outputs if out.error is None)
        self._stat_logger.maybe_log(self._prompt_tokens, self._generation_tokens)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Queue each item on its request's stream, waking each event loop once for all of them: one
        wake-up per output (a self-pipe write and a loop turn each) was a visible share of the event
        loop's CPU at 32 streams."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            finished = isinstance(item, BaseException) or item.finished
            stream = self._streams.pop(request_id, None) if finished else self._streams.get(request_id)
            if stream is not None:
                loop, queue = stream
                per_loop.setdefault(loop, []).append((queue, item))
        for loop, queued in per_loop.items():
            loop.call_soon_threadsafe(_put_all, queued)


def _run_call(engine: LLMEngine, fn: Callable[[LLMEngine], Any], loop: asyncio.AbstractEventLoop,
              future: asyncio.Future) -> None:
    """One `between_steps` call; its exception is its caller's, never the loop's."""
    try:
        result, error = fn(engine), None
    except Exception as e:
        result, error = None, e
    loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # its caller gave up (a client gone)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _failure(out: RequestOutput) -> RequestFailedError:
    kind = ConstraintFailedError if out.outputs[0].finish_reason == "error" else RequestFailedError
    return kind(out.error)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """One admitted request's outputs as an async iterator (deltas; the last is finished).

    `aclose()` before the end aborts the request, freeing its KV blocks before the next step; unlike an
    async generator's, it does so even when iteration never began.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.request_id = request_id
        self._llm = llm
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._llm.abort(self.request_id)
