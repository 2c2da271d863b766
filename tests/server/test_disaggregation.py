"""Disaggregated prefill and decode between real servers (`--role prefill` and `--role decode`), straight and through
the gateway: the decode instance pulls the prompt's KV blocks from the prefill instance and answers what one instance
answers, streamed or not; a pull that fails (nobody at the address, a transfer cut mid-body, blocks of another format)
is computed there instead; with the prefill instance gone the gateway falls back to the decode instance alone; no KV
block stays taken on either side after any of it; what a role does not do is refused. What one instance answers is
the prefill instance's own answer to the plain request."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from llmserve.loader import load_checkpoint
from llmserve.server.kv_transfer import SHM_DIR, SHM_PREFIX, SharedFiles, on_this_host, take_shared_file
from tests.gateway.conftest import GatewayProcess
from tests.quantization.tiny_models import make_tiny_hf_dir
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.processes

PROMPT = " ".join(f"Item {i}: the quick brown fox jumps." for i in range(12))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-pd", numbered=False), "qwen2", kv_heads=2))


def _outward_address() -> str | None:
    """This host's address on its network (no packet is sent), or None where it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _shm_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{SHM_PREFIX}*")} if SHM_DIR.is_dir() else set()


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("pd-logs")
    # the prefill instance listens beyond loopback too, so that a pull can come over TCP as from another host
    started = {role: ServerProcess(logs / f"{role}.log", "--model", tiny, "--role", role,
                                   *(("--host", "0.0.0.0") if role == "prefill" else ()))
               for role in ("prefill", "decode")}
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


def _ask(server: ServerProcess, transfer: dict | None = None, prompt: str = PROMPT, max_tokens: int = 16
         ) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="-")
    body = {"kv_transfer_params": transfer} if transfer else {}
    return client.completions.create(model="tiny-pd", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=body)


def _assert_no_block_taken(*servers: ServerProcess) -> None:
    for server in servers:
        m = server.metrics()
        assert m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"], server.log_path


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_the_decode_instance_answers_from_the_prefill_instances_blocks(tiny, servers, transport):
    """On this host the bytes come through a shared-memory file (none left behind); from an address of the host's
    network, as from another host, over TCP."""
    prefill, decode = servers["prefill"], servers["decode"]
    address = prefill.base if transport == "shm" else _outward_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    if transport == "tcp":
        address = f"http://{address}:{prefill.port}"
    assert on_this_host(address) == (transport == "shm")
    prompt = f"{transport}: {PROMPT}"
    full_blocks = (len(load_checkpoint(tiny).tokenizer.encode(prompt)) - 1) // 16  # all a prefix hit can cover
    assert full_blocks >= 5
    expected = _ask(prefill, prompt=prompt).choices[0].text
    before, files = decode.metrics(), _shm_files()
    _ask(prefill, {"do_remote_decode": True}, max_tokens=1, prompt=prompt)
    transfer = {"do_remote_prefill": True, "remote_url": address}
    exported = prefill.metrics()["llmserve:kv_transfer_blocks_total"]
    assert _ask(decode, transfer, prompt=prompt).choices[0].text == expected
    after = decode.metrics()
    # the prompt's full blocks came over, and the prefix cache found them: only its last tokens computed here
    assert after["llmserve:kv_transfer_blocks_total"] - before["llmserve:kv_transfer_blocks_total"] == full_blocks
    assert after["llmserve:prefix_cache_hits_total"] - before["llmserve:prefix_cache_hits_total"] == 16 * full_blocks
    assert prefill.metrics()["llmserve:kv_transfer_blocks_total"] - exported == full_blocks
    assert _shm_files() == files
    # streamed, the same tokens; the blocks are already here, so nothing more is pulled
    client = openai.OpenAI(base_url=f"{decode.base}/v1", api_key="-")
    stream = client.completions.create(model="tiny-pd", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"kv_transfer_params": transfer})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected
    assert decode.metrics()["llmserve:kv_transfer_blocks_total"] == after["llmserve:kv_transfer_blocks_total"]
    _assert_no_block_taken(prefill, decode)


def test_a_client_gone_mid_stream_leaves_no_block_taken(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    prompt = PROMPT + " And once more, the lazy dog sleeps."  # blocks the decode instance does not hold yet
    httpx.post(f"{prefill.base}/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
    body = {"prompt": prompt, "max_tokens": 500, "ignore_eos": True, "stream": True,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_url": prefill.base}}
    with httpx.stream("POST", f"{decode.base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event: the request runs, its blocks are taken
    deadline = 50
    while decode.metrics()["llmserve:num_kv_blocks_free"] != decode.metrics()["llmserve:num_kv_blocks_total"]:
        deadline -= 1
        assert deadline, "the aborted request's blocks never came back"
        threading.Event().wait(0.1)
    _assert_no_block_taken(prefill, decode)


class _CutTransfer:
    """A prefill instance that dies mid-transfer, or answers blocks of another format: an HTTP server on a socket
    that answers a pull with `headers` and `body`, then closes the connection (a `Content-Length` above the body's
    length cuts it short)."""

    def __init__(self, headers: dict[str, str], body: bytes) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.served = 0
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.answer = f"HTTP/1.1 200 OK\r\n{head}\r\n".encode() + body
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 20)
                conn.sendall(self.answer)
                self.served += 1


@pytest.mark.parametrize("fault", ["nobody there", "cut mid-body", "another format"])
def test_a_failed_pull_is_computed_here_and_leaves_no_block_taken(servers, fault):
    prefill, decode = servers["prefill"], servers["decode"]
    prompt_note = {"nobody there": "alpha", "cut mid-body": "beta", "another format": "gamma"}[fault]
    prompt = f"{prompt_note}: " + PROMPT  # blocks neither instance holds yet
    fmt = json.loads(httpx.post(f"{prefill.base}/v1/kv/blocks", json={"block_hashes": [], "token_ids": []},
                                timeout=30).headers["x-llmserve-kv-format"])
    block_bytes = 2 * 2 * 2 * 16 * 32 * 4  # K and V, 2 layers, 2 KV heads, 16 tokens, head_dim 32, float32
    if fault == "nobody there":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once this block ends
    elif fault == "cut mid-body":
        url = _CutTransfer({"x-llmserve-kv-format": json.dumps(fmt), "x-llmserve-kv-blocks": "5",
                            "Content-Length": str(5 * block_bytes)}, bytes(2 * block_bytes)).url
    else:
        url = _CutTransfer({"x-llmserve-kv-format": json.dumps({**fmt, "block_size": 32}),
                            "x-llmserve-kv-blocks": "5", "Content-Length": str(5 * block_bytes)},
                           bytes(5 * block_bytes)).url
    expected = httpx.post(f"{prefill.base}/v1/completions", json={"prompt": prompt, "max_tokens": 16,
                                                               "temperature": 0}, timeout=60).json()
    before, refused_before = decode.metrics(), decode.log().count("KVFormatError")
    answer = httpx.post(f"{decode.base}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_url": url}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    after = decode.metrics()
    assert after["llmserve:kv_transfer_failures_total"] == before.get("llmserve:kv_transfer_failures_total", 0) + 1
    assert after["llmserve:kv_transfer_blocks_total"] == before["llmserve:kv_transfer_blocks_total"]
    assert decode.log().count("KVFormatError") == refused_before + (fault == "another format")
    _assert_no_block_taken(decode)


@pytest.mark.parametrize(("role", "transfer", "status", "needle"), [
    ("decode", {"do_remote_decode": True}, 400, "role is decode"),
    ("prefill", {"do_remote_prefill": True, "remote_url": "http://127.0.0.1:9"}, 400, "role is prefill"),
    ("decode", {"do_remote_prefill": True}, 400, "remote_url"),
    ("decode", {"do_remote_prefill": True, "remote_url": "file:///etc/passwd"}, 400, "remote_url"),
])
def test_what_a_role_does_not_do_is_refused(servers, role, transfer, status, needle):
    answer = httpx.post(f"{servers[role].base}/v1/completions", timeout=30,
                        json={"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": transfer})
    assert answer.status_code == status
    assert needle in answer.json()["error"]["message"]
    # a decode instance has no blocks to give
    assert httpx.post(f"{servers['decode'].base}/v1/kv/blocks", json={"block_hashes": [], "token_ids": []},
                      timeout=30).status_code == 404


def test_the_gateway_sends_prefill_then_decode_and_falls_back_when_the_prefill_instance_is_gone(servers, tmp_path):
    """Last in this module: it stops the prefill instance."""
    prefill, decode = servers["prefill"], servers["decode"]
    config = {"models": {"tiny-pd": {"prefill": [prefill.base], "decode": [decode.base]}},
              "cache": {"exact": False}, "health": {"interval": 0.5, "timeout": 2.0}}
    gateway = GatewayProcess(tmp_path, config)
    try:
        client = openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="-")
        prompt = "delta: " + PROMPT
        expected = httpx.post(f"{prefill.base}/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": 16, "temperature": 0}).json()["choices"][0]["text"]
        imported = decode.metrics()["llmserve:kv_transfer_blocks_total"]
        raw = client.completions.with_raw_response.create(model="tiny-pd", prompt=prompt, max_tokens=16,
                                                          temperature=0)
        assert raw.headers["x-llmserve-disaggregation"] == f"prefill={prefill.base}; decode={decode.base}"
        assert raw.parse().choices[0].text == expected
        assert decode.metrics()["llmserve:kv_transfer_blocks_total"] > imported
        chat = [{"role": "user", "content": "epsilon: " + PROMPT}]
        expected_chat = httpx.post(f"{prefill.base}/v1/chat/completions", timeout=60, json={
            "messages": chat, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["message"]["content"]
        stream = client.chat.completions.create(model="tiny-pd", messages=chat, max_tokens=12, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_chat
        _assert_no_block_taken(prefill, decode)
        last = httpx.post(f"{prefill.base}/v1/completions", timeout=60, json={
            "prompt": "zeta: " + PROMPT, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
        prefill.stop()
        raw = client.completions.with_raw_response.create(model="tiny-pd", prompt="zeta: " + PROMPT, max_tokens=8,
                                                          temperature=0)
        # no `both` instance configured: the decode instance computes the prompt itself
        assert raw.headers["x-llmserve-disaggregation"] == f"fallback={decode.base}; reason=prefill failed"
        assert raw.parse().choices[0].text == last
        assert gateway.total("llmserve:gateway_disaggregated_requests_total") == 3
        _assert_no_block_taken(decode)
    finally:
        gateway.stop()


def test_only_our_own_shared_files_are_read_and_an_untaken_one_is_swept(tmp_path):
    if not SharedFiles.available():
        pytest.skip("no writable /dev/shm")
    for name in ("/etc/hostname", str(SHM_DIR / "not-ours"), str(tmp_path / f"{SHM_PREFIX}x")):
        with pytest.raises(ValueError, match="not a KV transfer file"):
            take_shared_file(name)
    shared = SharedFiles()
    taken, left = shared.write(b"abc"), shared.write(b"def")
    assert take_shared_file(str(taken)) == b"abc" and not taken.exists()
    shared.sweep(max_age_s=0)  # as if its asker had died: the writer removes it
    assert not left.exists() and not shared.written
