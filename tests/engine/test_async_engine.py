"""The serving engine's admission: requests and aborts never wait for a step, and a burst joins the next step
together. Another thread holds the engine lock, as a running step does, while the event loop adds and aborts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest

from llmserve.config import engine_config
from llmserve.engine.async_engine import AsyncLLM, NewRequest, QueueFullError
from llmserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    llm = AsyncLLM(engine_config(kv_cache_memory_gb=0.25, max_model_len=512), max_queued_requests=10)
    scheduled: list[list[str]] = []  # each step's newly admitted request ids
    schedule = llm.engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        scheduled.append([r.request_id for r in out.new_requests])
        return out

    llm.engine.scheduler.schedule = recording
    yield llm, scheduled
    llm.shutdown(30)


@contextlib.contextmanager
def _a_step_running(llm: AsyncLLM, at_most_s: float = 10.0) -> Iterator[threading.Event]:
    """The engine lock held by another thread, as the step loop holds it for a step, until the block ends (or
    `at_most_s` passed: then the event is set, and a caller that had to wait for the lock would see it set)."""
    held, done, gave_up = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with llm._cond:
            held.set()
            if not done.wait(at_most_s):
                gave_up.set()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        yield gave_up
    finally:
        done.set()
        holder.join()


async def _tokens(stream) -> list[int]:
    tokens: list[int] = []
    async for out in stream:
        tokens += out.outputs[0].token_ids
    return tokens


def _prompts(llm: AsyncLLM, n: int) -> list[list[int]]:
    return [llm.processor.encode(f"Question {i}: name a colour.") for i in range(n)]


def test_a_burst_added_during_a_step_joins_the_next_step_together(served):
    llm, scheduled = served
    prompts = _prompts(llm, 8)

    async def main() -> list[list[int]]:
        with _a_step_running(llm) as gave_up:  # before, each add waited for the step, and the event loop with it
            streams = llm.add_requests([NewRequest(p, PARAMS, f"burst-{i}") for i, p in enumerate(prompts)])
            with pytest.raises(QueueFullError):  # 8 queued of 10: the bound counts requests not yet taken
                llm.add_requests([NewRequest(p, PARAMS) for p in prompts[:3]])
            assert not gave_up.is_set()  # neither call waited for the step
            scheduled.clear()
        return await asyncio.gather(*(_tokens(s) for s in streams))

    outputs = asyncio.run(main())
    assert [len(t) for t in outputs] == [6] * 8
    assert sorted(scheduled[0]) == sorted(f"burst-{i}" for i in range(8))  # one step admitted them all
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_a_request_aborted_before_the_engine_took_it_never_reaches_it(served):
    llm, scheduled = served
    kept, dropped = _prompts(llm, 2)

    async def main() -> list[int]:
        with _a_step_running(llm) as gave_up:
            stream, gone = llm.add_requests([NewRequest(kept, PARAMS, "kept"), NewRequest(dropped, PARAMS, "gone")])
            await gone.aclose()
            assert not gave_up.is_set()
            scheduled.clear()
        with pytest.raises(ValueError, match="already in use"):
            llm.add_requests([NewRequest(kept, PARAMS, "kept")])
        return await _tokens(stream)

    assert len(asyncio.run(main())) == 6
    assert [rid for step in scheduled for rid in step] == ["kept"]
    assert "gone" not in llm.engine.requests
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
