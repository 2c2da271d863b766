"""`llmserve serve --tensor-parallel-size 2` or `--pipeline-parallel-size 2`: answers through the OpenAI client
like one rank does, and when a rank dies, /health turns 503 and the server exits non-zero within a bounded time,
leaving no process behind."""

from __future__ import annotations

import time

import httpx
import openai
import psutil
import pytest

from tests.quantization.tiny_models import make_tiny_hf_dir
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-tp-serve", numbered=False), "qwen2", kv_heads=2))


def _workers(proc: psutil.Process) -> list[psutil.Process]:
    """The rank processes the server started (not multiprocessing's resource tracker)."""
    return [p for p in proc.children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


ASK = dict(model="tiny-tp-serve", prompt="The capital of France is", max_tokens=12, temperature=0)


def _answer(server: ServerProcess) -> str:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="-").completions.create(**ASK).choices[0].text


@pytest.fixture(scope="module")
def one_rank_answer(tiny, tmp_path_factory) -> str:
    one = ServerProcess(tmp_path_factory.mktemp("one-rank") / "one.log", "--model", tiny)
    try:
        one.wait_ready()
        return _answer(one)
    finally:
        assert one.stop() == 0


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_a_dead_rank_makes_the_server_unhealthy_and_exit_non_zero(tiny, tmp_path, flag, one_rank_answer):
    two = ServerProcess(tmp_path / "two.log", "--model", tiny, flag, "2")
    try:
        two.wait_ready()
        assert _answer(two) == one_rank_answer and one_rank_answer
        # a prompt's KV moves between one process's caches only (server/kv_transfer.py)
        refused = httpx.post(f"{two.base}/v1/completions", timeout=30, json={
            **ASK, "kv_transfer_params": {"do_remote_prefill": True, "remote_url": "http://127.0.0.1:9"}})
        assert refused.status_code == 400 and "parallel ranks" in refused.json()["error"]["message"]
        [worker] = _workers(psutil.Process(two.proc.pid))
        worker.kill()
        start = time.monotonic()
        statuses = []
        while two.proc.poll() is None and time.monotonic() - start < 30:
            try:
                statuses.append(httpx.get(f"{two.base}/health", timeout=2).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        exited_after = time.monotonic() - start
    finally:
        code = two.stop()
    log = two.log_path.read_text()
    assert code == 1, log
    assert "parallel rank died" in log and exited_after < 30
    # healthy until the death is noticed, then 503 until the exit, never healthy again; the server may exit before
    # a probe sees the 503 (seen once in CI: [200] alone), which the exit code and the log above then stand for
    assert statuses and statuses == sorted(statuses) and set(statuses) <= {200, 503}, statuses
    time.sleep(1)
    assert not [p for p in psutil.process_iter(["cmdline"]) if tiny in " ".join(p.info["cmdline"] or [])]
