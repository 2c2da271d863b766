"""What a hostile-but-fair probe found, one test per finding, against one real server process.

The server runs with an API key, a queue of 4 sequences, 2-second request deadlines, a connection cap,
CORS for one origin, a default output cap of 8 tokens and a 2-second shutdown timeout. The last test
stops it with SIGTERM while requests are open.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, ServerProcess

KEY = "sk-hardening-31c4"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
MAX_CONNECTIONS = 16
DEFAULT_CAP = 8
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Write one sentence about rivers."}]}


@pytest.fixture(scope="module")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    proc = ServerProcess(tmp_path_factory.mktemp("hardened") / "server.log", "--api-key", KEY,
                         "--max-queued-requests", "4", "--request-timeout", "2",
                         "--max-connections", str(MAX_CONNECTIONS), "--allowed-origins", ORIGIN,
                         "--max-tokens-default", str(DEFAULT_CAP), "--shutdown-timeout", "2")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def post(server: ServerProcess, path: str, body: dict | bytes, **headers: str) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{server.base}{path}", headers={**AUTH, "Content-Type": "application/json", **headers},
                      timeout=120, **kwargs)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# --- 0. one request cannot fail everyone's ----------------------------------------------------------


def test_0_top_k_past_the_vocabulary_fails_nobody(hardened: ServerProcess) -> None:
    greedy = [{**CHAT, "messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 16,
               "temperature": 0, "ignore_eos": True} for i in range(2)]
    alone = [post(hardened, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
             for body in greedy]
    seeded = {**CHAT, "temperature": 1.0, "seed": 11, "max_tokens": 16, "ignore_eos": True}
    huge_top_k = [{**seeded, "top_k": 49153}, {**seeded, "top_k": 10**9}]

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=hardened.base, headers=AUTH, timeout=120) as http:
            return await asyncio.gather(*[http.post("/v1/chat/completions", json=b) for b in greedy + huge_top_k])

    responses = asyncio.run(together())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    texts = [r.json()["choices"][0]["message"]["content"] for r in responses]
    assert texts[:2] == alone  # the others in the step got exactly their tokens
    unrestricted = post(hardened, "/v1/chat/completions", {**seeded, "top_k": -1}).json()
    assert texts[2] == texts[3] == unrestricted["choices"][0]["message"]["content"]  # top_k >= vocab: no filter
    assert_error(post(hardened, "/v1/chat/completions", {**CHAT, "stop_token_ids": [49152]}), 400,
                 param="stop_token_ids")
    assert hardened.wait_idle()["llmserve:num_kv_blocks_free"] == hardened.metrics()["llmserve:num_kv_blocks_total"]


# --- 2. what can never be admitted is a 400, not a 429 ------------------------------------------------


def test_2_more_sequences_than_the_queue_holds_is_a_400(hardened: ServerProcess) -> None:
    error = assert_error(post(hardened, "/v1/chat/completions", {**CHAT, "n": 5, "max_tokens": 2}), 400,
                         param="n", code="too_many_sequences")
    assert "--max-queued-requests" in error["message"]
    assert_error(post(hardened, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 3, "max_tokens": 2}),
                 400, param="n", code="too_many_sequences")
    ok = post(hardened, "/v1/chat/completions", {**CHAT, "n": 4, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


# --- 3. bad text is a 400 ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_3_a_lone_surrogate_is_a_400(hardened: ServerProcess, path: str) -> None:
    field = b'"messages":[{"role":"user","content":"hi \\ud800"}]' if "chat" in path else b'"prompt":"hi \\udfff x"'
    error = assert_error(post(hardened, path, b"{" + field + b',"max_tokens":2}'), 400)
    assert "not valid JSON" in error["message"] and "surrogate" in error["message"]
    # an escaped surrogate *pair* is one valid character
    pair = post(hardened, "/v1/chat/completions",
                b'{"messages":[{"role":"user","content":"hi \\ud83d\\ude00"}],"max_tokens":2}')
    assert pair.status_code == 200, pair.text


# --- 4. every float finite and in range; seeds that fit ----------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', None),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":Infinity}', None),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":1e999}', None),
    (b'{"messages":[{"role":"user","content":"hi"}],"repetition_penalty":NaN}', None),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":2.5}', "temperature"),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":1e9}', "temperature"),
    (b'{"messages":[{"role":"user","content":"hi"}],"top_p":1.5}', "top_p"),
    (b'{"messages":[{"role":"user","content":"hi"}],"repetition_penalty":0}', "repetition_penalty"),
    (b'{"messages":[{"role":"user","content":"hi"}],"seed":18446744073709551616}', "seed"),
    (b'{"messages":[{"role":"user","content":"hi"}],"seed":-9223372036854775809}', "seed"),
])
def test_4_bad_numbers_are_400s_naming_the_field(hardened: ServerProcess, body: bytes, param: str | None) -> None:
    error = assert_error(post(hardened, "/v1/chat/completions", body), 400, param=param)
    assert param is not None or "not valid JSON" in error["message"]
    assert "Overflow" not in error["message"]


@pytest.mark.parametrize(("field", "value"), [("stream", b"0"), ("logprobs", b"1.0"), ("echo", b"1")])
def test_4_a_number_is_not_a_boolean(hardened: ServerProcess, field: str, value: bytes) -> None:
    """The schema says boolean; pydantic's lax mode would read 0, 1.0 as False/True (found by fuzzing)."""
    path = "/v1/completions" if field == "echo" else "/v1/chat/completions"
    prompt = b'"prompt":"hi"' if field == "echo" else b'"messages":[{"role":"user","content":"hi"}]'
    body = b"{" + prompt + b',"max_tokens":1,"' + field.encode() + b'":' + value + b"}"
    assert_error(post(hardened, path, body), 400, param=field)


@pytest.mark.parametrize(("field", "value"), [("frequency_penalty", True), ("temperature", "0.5"),
                                               ("max_tokens", True), ("n", "1"), ("stop_token_ids", [False])])
def test_4_a_boolean_or_a_string_is_not_a_number(hardened: ServerProcess, field: str, value: object) -> None:
    """The schema says number or integer; pydantic's lax mode would read true as 1 and "1" as 1 (found by
    fuzzing: `"frequency_penalty": true` answered 200). Integers stay numbers (`"temperature": 0`)."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}).encode()
    assert_error(post(hardened, "/v1/chat/completions", body), 400, param=field)
    whole = post(hardened, "/v1/chat/completions",
                 b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"temperature":0,"top_p":1}')
    assert whole.status_code == 200, whole.text


@pytest.mark.parametrize("prompt", [b"[-83882856282, 537]", b"[537, 99999999]", b"[[537], []]"])
def test_4_echoed_token_ids_outside_the_vocabulary_are_a_400(hardened: ServerProcess, prompt: bytes) -> None:
    """Echo decodes the prompt before the engine admits it: an id past any integer type was a 500 (fuzzer)."""
    body = b'{"prompt":' + prompt + b',"echo":true,"max_tokens":1}'
    assert_error(post(hardened, "/v1/completions", body), 400, param="prompt")


def test_4_the_largest_seed_works_and_its_choices_wrap(hardened: ServerProcess) -> None:
    r = post(hardened, "/v1/chat/completions", {**CHAT, "seed": 2**64 - 1, "n": 2, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# --- 5. reproducibility and logprob bytes ------------------------------------------------------------


def test_5_a_seeded_request_is_the_same_alone_and_in_a_batch(hardened: ServerProcess) -> None:
    """float32, unquantized: README, "Reproducibility", says where this holds."""
    seeded = {**CHAT, "temperature": 0.8, "seed": 1234, "max_tokens": 48}
    alone = post(hardened, "/v1/chat/completions", seeded).json()["choices"][0]["message"]["content"]

    async def batch() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=hardened.base, headers=AUTH, timeout=120) as http:
            other = {**CHAT, "messages": [{"role": "user", "content": "Name a color."}], "temperature": 1.0,
                     "max_tokens": 40}
            return await asyncio.gather(*[http.post("/v1/chat/completions", json=b) for b in (seeded, other, seeded)])

    texts = [r.json()["choices"][0]["message"]["content"] for r in asyncio.run(batch())]
    assert texts[0] == texts[2] == alone
    n = post(hardened, "/v1/chat/completions", {**seeded, "n": 3}).json()
    assert n["choices"][0]["message"]["content"] == alone


def test_5_chat_logprob_bytes_rebuild_the_text(hardened: ServerProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Reply with three emoji."}],
            "temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 2}
    whole = post(hardened, "/v1/chat/completions", body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    text = whole["message"]["content"]
    assert any(ord(c) > 0xFFFF for c in text), text  # characters of 4 UTF-8 bytes, split across tokens
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == text
    assert any(entry["token"] == "\ufffd" for entry in content)  # where only the bytes tell
    assert all(isinstance(top["bytes"], list) and top["bytes"] for entry in content for top in entry["top_logprobs"])
    streamed = []
    with httpx.stream("POST", f"{hardened.base}/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lps = json.loads(line[6:])["choices"][0].get("logprobs")
                streamed += (lps or {}).get("content") or []
    assert [e["bytes"] for e in streamed] == [e["bytes"] for e in content]


# --- 6. slow and partial clients ---------------------------------------------------------------------


def _raw(server: ServerProcess, data: bytes, wait: float = 10.0) -> tuple[float, bytes]:
    """Send bytes on a fresh connection and read until the server closes it: (seconds taken, reply)."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(data)
        s.settimeout(wait)
        start, reply = time.monotonic(), b""
        while chunk := s.recv(65536):
            reply += chunk
        return time.monotonic() - start, reply


def test_6_a_body_shorter_than_its_length_times_out(hardened: ServerProcess) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n")
    took, reply = _raw(hardened, head + b'{"prompt": "hi"')
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply and took < 8
    took, reply = _raw(hardened, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply and took < 8
    took, reply = _raw(hardened, b"")  # connected, silent: closed without a word
    assert reply == b"" and took < 8


def test_6_connections_past_the_cap_get_503(hardened: ServerProcess) -> None:
    held = [socket.create_connection(("127.0.0.1", hardened.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        r = httpx.get(f"{hardened.base}/v1/models", headers=AUTH, timeout=10)
        error = assert_error(r, 503, code="too_many_connections")
        assert r.headers["retry-after"] == "1" and "--max-connections" in error["message"]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{hardened.base}/v1/models", headers=AUTH, timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the server did not recover below the connection cap"
        time.sleep(0.2)


# --- 7. HTTP conventions ----------------------------------------------------------------------------


def test_7_the_auth_scheme_is_case_insensitive(hardened: ServerProcess) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(f"{hardened.base}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, scheme
    assert_error(httpx.get(f"{hardened.base}/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401,
                 code="invalid_api_key")


def test_7_head_probes(hardened: ServerProcess) -> None:
    for path, headers in (("/health", {}), ("/v1/models", AUTH)):
        r = httpx.head(f"{hardened.base}{path}", headers=headers)
        assert r.status_code == 200 and r.content == b"", path


def test_7_cors_preflight_and_headers(hardened: ServerProcess) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{hardened.base}/v1/chat/completions", headers=preflight)  # a browser sends no key here
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "POST" in r.headers["access-control-allow-methods"]
    other = httpx.options(f"{hardened.base}/v1/chat/completions", headers={**preflight, "Origin": "http://x.example"})
    assert "access-control-allow-origin" not in other.headers
    refused = httpx.get(f"{hardened.base}/v1/models", headers={"Origin": ORIGIN})  # a 401 a page can read
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_7_api_docs_need_the_key(hardened: ServerProcess) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert_error(httpx.get(f"{hardened.base}{path}"), 401, code="invalid_api_key")
        assert httpx.get(f"{hardened.base}{path}", headers=AUTH).status_code == 200, path


def test_7_a_body_that_is_not_json_says_so(hardened: ServerProcess) -> None:
    r = post(hardened, "/v1/chat/completions", json.dumps(CHAT).encode(), **{"Content-Type": "text/plain"})
    error = assert_error(r, 415, code="unsupported_media_type")
    assert "application/json" in error["message"] and "text/plain" in error["message"]
    no_type = httpx.post(f"{hardened.base}/v1/chat/completions", content=json.dumps({**CHAT, "max_tokens": 2}),
                         headers=AUTH)  # no Content-Type at all: read as JSON
    assert no_type.status_code == 200, no_type.text


# --- 8. defaults and words --------------------------------------------------------------------------


def test_8_requests_without_max_tokens_stop_at_the_default_cap(hardened: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{hardened.base}/v1", api_key=KEY, max_retries=0)
    capped = client.chat.completions.create(**CHAT, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == DEFAULT_CAP and capped.choices[0].finish_reason == "length"
    asked = client.chat.completions.create(**CHAT, max_tokens=DEFAULT_CAP + 4, extra_body={"ignore_eos": True})
    assert asked.usage.completion_tokens == DEFAULT_CAP + 4  # the cap is a default, not a limit
    client.close()


def test_8_a_port_in_use_fails_at_once(hardened: ServerProcess) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "llmserve.cli", "serve", "--port", str(hardened.port)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Address already in use" in done.stderr, done.stderr
    assert time.monotonic() - start < 10 and "KV cache" not in done.stderr  # before any model loading


def test_8_help_says_which_served_name_is_reported() -> None:
    done = subprocess.run([sys.executable, "-m", "llmserve.cli", "serve", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert "reports the name its request used" in " ".join(done.stdout.split())
    assert "--max-tokens-default" in done.stdout and "--allowed-origins" in done.stdout


# --- 1. forced shutdown ends every response properly (last: it stops the server) ---------------------


def test_1_sigterm_past_the_timeout_ends_every_response_properly(hardened: ServerProcess) -> None:
    long = {**CHAT, "max_tokens": 1500, "ignore_eos": True}

    async def stream(http: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
        events = []
        async with http.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        started.set()
        return events

    async def main() -> tuple[list[list[str]], list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=hardened.base, headers=AUTH, timeout=120) as http:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(stream(http, e)) for e in started]
            whole = [asyncio.create_task(http.post("/v1/chat/completions", json=long)) for _ in range(2)]
            for e in started:
                await e.wait()
            hardened.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            return await asyncio.gather(*streams), await asyncio.gather(*whole), time.monotonic() - t0

    streams, whole, took = asyncio.run(main())
    for events in streams:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last.get("error", {}).get("code") == "engine_dead" or last["choices"][0]["finish_reason"], last
        assert all(json.loads(e) for e in events[:-1])  # every event whole: nothing cut mid-body
    for r in whole:
        assert "shut down" in assert_error(r, 503)["message"]
    assert took < 2 + 5 + 5, took  # the timeout, then the flush grace, not a 1500-token generation
    assert hardened.proc.wait(30) == 0, hardened.log()
