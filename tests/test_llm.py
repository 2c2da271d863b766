"""The offline API's thread check: a model stepped from a thread other than its living loader is said once."""

from __future__ import annotations

import logging
import threading

import pytest

from llmserve import LLM, SamplingParams

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _small_llm() -> LLM:
    return LLM(dtype="float32", quantization="none", kv_cache_memory_gb=0.05, max_model_len=256)


def _thread_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "was loaded in thread" in r.getMessage()]


def _in_thread(fn, name: str) -> None:
    worker = threading.Thread(target=fn, name=name)
    worker.start()
    worker.join()


def test_generating_beside_the_living_loader_thread_warns_once_with_the_same_tokens(caplog):
    llm = _small_llm()
    with caplog.at_level(logging.WARNING, logger="llmserve.llm"):
        here = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert _thread_warnings(caplog) == []  # the loader's own thread
        there: list[list[int]] = []

        def batch() -> None:
            there.extend(out.outputs[0].token_ids for out in llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False))

        _in_thread(batch, "worker-a")
        _in_thread(lambda: llm.generate(PROMPT, GREEDY, use_tqdm=False), "worker-b")
    warnings = _thread_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "'worker-a'" in warnings[0] and f"'{threading.current_thread().name}'" in warnings[0]
    assert there == [here, here]


def test_a_model_whose_loader_thread_ended_steps_anywhere_without_a_warning(caplog):
    loaded: list[LLM] = []
    _in_thread(lambda: loaded.append(_small_llm()), "loader")
    with caplog.at_level(logging.WARNING, logger="llmserve.llm"):
        out = loaded[0].generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens
    assert _thread_warnings(caplog) == []
