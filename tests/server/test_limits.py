"""A server with an API key, one batch slot and a queue of one: auth, 429 backpressure, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, ServerProcess

KEY = "sk-test-7d1e5c0a"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    proc = ServerProcess(tmp_path_factory.mktemp("limited") / "server.log", "--api-key", KEY,
                         "--max-queued-requests", "1", "--max-num-seqs", "1", "--shutdown-timeout", "60")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_v1_routes_need_the_key(limited: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{limited.base}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{limited.base}/v1/models").status_code == 401
    assert httpx.post(f"{limited.base}/v1/completions", json=body, headers=AUTH).status_code == 200
    # probes and scrapers carry no key
    assert httpx.get(f"{limited.base}/health").status_code == 200
    assert httpx.get(f"{limited.base}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{limited.base}/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=f"{limited.base}/v1", api_key=KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert KEY not in limited.log()


def test_full_queue_answers_429_with_retry_after(limited: ServerProcess) -> None:
    long_body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 300, "ignore_eos": True,
                 "stream": True}

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(base_url=limited.base, headers=AUTH, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=long_body) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass  # a token arrived: this one holds the only batch slot
                async with http.stream("POST", "/v1/completions", json=long_body) as queued:
                    assert queued.status_code == 200  # admitted: it waits in the queue of one
                    return await http.post("/v1/completions", json={**long_body, "stream": False})

    refused = asyncio.run(main())
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    m = limited.wait_idle()  # both streams were closed by the client: aborted, blocks back
    assert m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"]
    ok = httpx.post(f"{limited.base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                    headers=AUTH)
    assert ok.status_code == 200


def test_sigterm_lets_the_running_stream_finish_then_exits_0(limited: ServerProcess) -> None:
    """Runs last in this module: it stops the module's server."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{limited.base}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if len(events) == 2:
                limited.proc.send_signal(signal.SIGTERM)
                # no new work while draining: refused connection, or 503 on a live one
                try:
                    late = httpx.get(f"{limited.base}/health", timeout=5)
                    assert late.status_code == 503
                except httpx.TransportError:
                    pass
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 40
    try:
        code = limited.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server still running 60 s after SIGTERM:\n{limited.log()}")
    assert code == 0, limited.log()
    assert "engine stopped" in limited.log()
