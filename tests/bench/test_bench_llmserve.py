"""`llmserve bench` against the real `llmserve serve` (default model, SmolLM2-135M from its GGUF), end to end.

One server for the module (float32, small KV cache: see tests/server/conftest.py); `llmserve bench` runs as
a subprocess, exactly as a user would run it. The tokenizer is the one the engine caches from the GGUF the
first time it loads it (llmserve/loader/gguf.py `_tokenizer`), so prompt lengths are exact.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import ServerProcess

from .helpers import ROOT

MODEL = "smollm2"
INPUT_LEN, OUTPUT_LEN = 64, 16
LEVELS = {1: 4, 4: 8}  # concurrency: requests

SUMMARY_KEYS = {
    "mode", "label", "concurrency", "num_requests", "num_ok", "num_failed", "errors_by_kind", "wall_s",
    "output_tokens_total", "output_tokens_per_req_mean", "output_tokens_per_req_min",
    "output_tokens_per_req_max", "prompt_tokens_server_mean", "prompt_tokens_expected_mean",
    "output_tok_per_s", "total_tok_per_s", "req_per_s", "chunks_per_req_mean",
    *(f"{m}_{s}_ms" for m in ("ttft", "itl", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99")),
}
RECORD_KEYS = {
    "stream", "index", "ok", "error_kind", "error", "http_status", "start_ms", "ttft_ms", "latency_ms",
    "tpot_ms", "itl_ms", "chunk_times_ms", "chunk_tokens", "output_tokens", "output_tokens_source",
    "prompt_tokens", "prompt_tokens_expected", "max_tokens", "finish_reason", "text",
}
DOC_KEYS = {"schema", "engine", "timestamp", "started_unix", "finished_unix", "server", "config", "client",
            "workload", "client_host", "notes", "warmup", "summary", "levels", "complete"}


def cached_tokenizer_dir() -> Path:
    """Where the engine cached the GGUF's tokenizer: the same path as llmserve.loader.gguf._tokenizer."""
    from llmserve.loader.default_models import resolve_model_path

    gguf, _name = resolve_model_path(None)
    st = os.stat(gguf)
    root = os.environ.get("LLMSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "llmserve"))
    return Path(root) / "tokenizers" / f"{os.path.basename(gguf)}-{st.st_size}-{st.st_mtime_ns}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """The real default server and the tokenizer directory it cached while loading the model."""
    proc = ServerProcess(tmp_path_factory.mktemp("llmserve") / "server.log", "--served-model-name", MODEL)
    try:
        proc.wait_ready()
        tok = cached_tokenizer_dir()
        assert (tok / "tokenizer.json").is_file(), f"no cached tokenizer at {tok}"
        yield proc, tok
    finally:
        proc.stop()


def bench(base: str, tok: Path, out: Path, *extra: str, input_len: int = INPUT_LEN) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "llmserve.cli", "bench", "--base-url", base,
           "--concurrency", ",".join(map(str, LEVELS)), "--num-requests", ",".join(map(str, LEVELS.values())),
           "--input-len", str(input_len), "--output-len", str(OUTPUT_LEN), "--warmup", "1",
           "--tokenizer", str(tok), "--out", str(out), "--no-progress", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def check_document(doc: dict[str, Any], label: str, input_len: int = INPUT_LEN) -> None:
    assert DOC_KEYS <= doc.keys(), DOC_KEYS - doc.keys()
    assert doc["complete"] is True and doc["engine"] == label
    assert doc["server"]["model"] == MODEL  # detected from GET /v1/models
    assert doc["workload"]["token_counting_exact"] is True
    assert doc["warmup"]["num_requests"] == 1 and doc["warmup"]["num_ok"] == 1
    assert [s["concurrency"] for s in doc["summary"]] == list(LEVELS)
    assert [lv["summary"] for lv in doc["levels"]] == doc["summary"]
    streams = set()
    for (conc, n), lv in zip(LEVELS.items(), doc["levels"], strict=True):
        s = lv["summary"]
        assert SUMMARY_KEYS <= s.keys(), SUMMARY_KEYS - s.keys()
        assert (s["mode"], s["label"]) == ("concurrency", f"c={conc}")
        assert (s["num_requests"], s["num_ok"], s["num_failed"], s["errors_by_kind"]) == (n, n, 0, {})
        assert s["output_tokens_total"] == n * OUTPUT_LEN
        assert s["output_tokens_per_req_min"] == s["output_tokens_per_req_max"] == OUTPUT_LEN
        assert s["output_tok_per_s"] > 0 and s["req_per_s"] > 0 and s["wall_s"] > 0
        assert s["prompt_tokens_expected_mean"] == input_len  # exact with the model's tokenizer
        assert abs(s["prompt_tokens_server_mean"] - input_len) <= 2  # what the server counted (usage)
        for m in ("ttft", "itl", "tpot", "e2e"):
            assert 0 < s[f"{m}_p50_ms"] <= s[f"{m}_p90_ms"] <= s[f"{m}_p99_ms"], m
        assert len(lv["requests"]) == n
        for r in lv["requests"]:
            assert RECORD_KEYS <= r.keys(), RECORD_KEYS - r.keys()
            assert r["ok"] and r["error"] is None and r["http_status"] == 200
            assert r["output_tokens"] == OUTPUT_LEN and r["output_tokens_source"] == "usage"
            assert r["max_tokens"] == OUTPUT_LEN and r["finish_reason"] == "length"
            assert r["prompt_tokens_expected"] == input_len and abs(r["prompt_tokens"] - input_len) <= 2
            assert sum(r["chunk_tokens"]) == OUTPUT_LEN and len(r["chunk_tokens"]) == len(r["chunk_times_ms"])
            # one ITL sample per token after the first: a chunk of k tokens (the server coalesces tokens
            # when the client reads slower than the engine) splits its gap into k samples
            assert len(r["itl_ms"]) == OUTPUT_LEN - 1
            assert 0 < r["ttft_ms"] <= r["latency_ms"] and r["tpot_ms"] > 0
            assert r["text"]
            streams.add(r["stream"])
    assert len(streams) == len(LEVELS)  # levels never share prompts


def test_bench_sweep_and_compare_against_llmserve(served: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    server, tok = served
    a, b = tmp_path / "a.json", tmp_path / "b.json"

    proc = bench(server.base, tok, a, "--label", "random")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server.log()
    assert "c=1" in proc.stdout and "c=4" in proc.stdout and f"wrote {a}" in proc.stdout
    check_document(json.loads(a.read_text()), "random")

    # a shared ~32-token system prompt + a distinct question per request (which alone is ~30 tokens: 128 in all)
    proc = bench(server.base, tok, b, "--label", "shared", "--workload", "shared-prefix", "--prefix-len", "32",
                 input_len=2 * INPUT_LEN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server.log()
    doc_b = json.loads(b.read_text())
    check_document(doc_b, "shared", input_len=2 * INPUT_LEN)
    assert doc_b["workload"]["name"] == "shared-prefix" and doc_b["workload"]["system_prompt_tokens"] >= 32
    first = doc_b["levels"][0]["requests"][0]["stream"]
    assert first.startswith("L0")

    # every request is gone: nothing running or waiting, every KV block free again
    m = server.wait_idle()
    assert m["llmserve:num_requests_running"] == 0 and m["llmserve:num_requests_waiting"] == 0

    cmp = subprocess.run([sys.executable, "-m", "llmserve.cli", "bench", "compare", str(a), str(b)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert cmp.returncode == 0, cmp.stderr
    out = cmp.stdout
    assert "random (a)" in out and "shared (b)" in out and "b/a" in out
    for level in ("c=1", "c=4"):
        assert level in out
    ratio_rows = [ln for ln in out.splitlines() if "out tok/s" in ln]
    assert len(ratio_rows) == len(LEVELS)
    assert all(re.search(r"\d+\.\d\dx\s*$", ln) for ln in ratio_rows), ratio_rows
    assert len(re.findall(r"\d+\.\d\dx", out)) >= 10 * len(LEVELS)
