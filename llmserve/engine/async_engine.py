"""The engine behind a server: one background thread runs the step loop; each request gets an
asyncio stream of incremental outputs.

Why a thread and not a process: on a 2-core machine the model's kernels release the GIL and use
both cores, and a thread hands outputs to the event loop with no serialisation. Engine state is
guarded by one condition lock: `add`/`abort` take it between steps, never during a forward pass
they would have to wait for twice.

The engine thread also *loads* the model, and no other thread runs a torch kernel. OpenMP keeps one
worker team per thread that ever entered a parallel region; once the process has more OpenMP threads
than cores, libgomp stops spinning and puts workers to sleep after every region, so each small op
pays a futex wake-up (measured: a 64x576 multiply 6 us -> 50-65 us, a decode step 20 -> 37 ms when the
model was loaded in one thread and stepped in another).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.stat_logger import StatLogger
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests are unaffected."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found there
    num_cached_blocks: int  # blocks findable by hash (in use or free)


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, max_queued_requests: int | None = None, log_interval_s: float = 10.0
    ) -> None:
        self.max_queued_requests = max_queued_requests
        self._cond = threading.Condition()
        # Callers (add/abort/stats) waiting for the lock; the step loop lets them in between steps.
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
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.engine.apply_chat_template(messages, add_generation_prompt)
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def stats(self) -> EngineStats:
        with self._turn():
            sched, kv = self.engine.scheduler, self.engine.kv_cache
            return EngineStats(
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
                num_kv_blocks=kv.num_blocks,
                num_free_kv_blocks=kv.num_free_blocks,
                kv_cache_usage=kv.usage,
                num_preemptions=sched.num_preemptions,
                prompt_tokens_total=self._prompt_tokens,
                generation_tokens_total=self._generation_tokens,
                prefix_cache_queries=kv.stats.queries,
                prefix_cache_hits=kv.stats.hits,
                num_cached_blocks=kv.pool.num_cached_blocks,
            )

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
        request_id = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._turn():
            if self._dead is not None:
                raise EngineDeadError(f"engine stopped: {self._dead}")
            if self._stopping:
                raise EngineDeadError("server is shutting down")
            if self.max_queued_requests is not None and len(self.engine.scheduler.waiting) >= self.max_queued_requests:
                raise QueueFullError(f"{self.max_queued_requests} requests are already waiting")
            req = self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
            self._prompt_tokens += req.num_prompt_tokens
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._cond.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._turn():
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop taking requests, let the running ones finish (up to timeout), stop the thread."""
        with self._turn():
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        with self._cond:
            open_ids = list(self._streams)
            self._deliver([(r, EngineDeadError("server shut down before the request finished")) for r in open_ids])
            for request_id in open_ids:
                self.engine.abort_request(request_id)
            self._dead = self._dead or EngineDeadError("shut down")

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """The engine lock, taken before the step loop's next step.

        A plain lock is unfair: the step loop re-takes it the moment it lets go, and a caller on
        the event loop waited over a second under load (measured), stalling every HTTP request.
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
        return self._thread.is_alive()

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
                with self._cond:
                    while not self.engine.has_unfinished_requests() and not self._stopping:
                        self._cond.wait()
                    if self._stopping and not self.engine.has_unfinished_requests():
                        return
                    self._step()
                    while self._num_callers:  # give way to callers queued on the lock (see _turn)
                        self._cond.wait()
        except BaseException as e:  # the loop itself broke: fail every open stream, say why
            logger.exception("engine loop died")
            with self._cond:
                self._dead = e
                self._deliver([(r, EngineDeadError(f"engine stopped: {e}")) for r in list(self._streams)])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a failed forward pass fails the requests it carried, not the server
            logger.exception("engine step failed; failing its requests")
            failed = list(self.engine.requests)
            for request_id in failed:
                self.engine.abort_request(request_id)
            self._deliver([(r, RequestFailedError(f"engine step failed: {e}")) for r in failed])
            return
        self._deliver([
            (out.request_id, RequestFailedError(out.error) if out.error else out) for out in outputs
        ])
        self._generation_tokens += sum(out.error is None for out in outputs)  # one new token each
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


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
