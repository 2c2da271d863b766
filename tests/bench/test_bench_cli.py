"""`llmserve bench` end to end: JSON output, plot, compare, exit codes, and the CLI wiring."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmserve.bench import cli

from .fake_server import FakeOpenAIServer
from .helpers import ROOT, free_port

SUMMARY_KEYS = {
    "mode", "label", "concurrency", "num_requests", "num_ok", "num_failed", "errors_by_kind", "wall_s",
    "output_tokens_total", "output_tokens_per_req_mean", "prompt_tokens_server_mean",
    "prompt_tokens_expected_mean", "output_tok_per_s", "total_tok_per_s", "req_per_s", "client_cpu_s",
    "goodput_req_per_s", "slo_attainment", "slo",
    *(f"{m}_{s}_ms" for m in ("ttft", "itl", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99")),
}
RECORD_KEYS = {
    "stream", "index", "ok", "error_kind", "error", "http_status", "start_ms", "ttft_ms", "latency_ms",
    "tpot_ms", "itl_ms", "chunk_times_ms", "chunk_tokens", "output_tokens", "output_tokens_source",
    "prompt_tokens", "prompt_tokens_expected", "max_tokens", "finish_reason", "text",
}


def _bench(base: str, *extra: str) -> int:
    return cli.main(["--base-url", base, "--no-progress", "--warmup", "0", "--input-len", "32",
                     "--output-len", "16", *extra])


def test_json_output_has_every_field_and_plot_is_png(
    fake_server: FakeOpenAIServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = _bench(fake_server.base("paced"), "--concurrency", "1,2", "--num-requests", "2,4", "--warmup", "1",
                "--tokenizer", str(tokenizer_dir), "--slo", "ttft=500ms,tpot=50ms", "--api-key", "k",
                "--out", str(out), "--plot", str(png))
    assert rc == 0
    text = capsys.readouterr().out
    assert "c=1" in text and "c=2" in text and "TTFT p50" in text and "APPROXIMATE" not in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == "llmserve-bench/1" and doc["complete"] is True
    assert {"engine", "timestamp", "started_unix", "finished_unix", "server", "config", "client",
            "workload", "client_host", "notes", "warmup", "summary", "levels"} <= doc.keys()
    assert doc["server"]["model"] == "fake-model"  # found via GET /v1/models
    assert doc["server"]["base_url"] == fake_server.base("paced") and doc["server"]["endpoint"] == "chat"
    assert doc["config"]["api_key"] == "***" and doc["client"]["api_key"] == "***"
    assert doc["workload"]["token_counting_exact"] is True and doc["workload"]["name"] == "random"
    assert doc["warmup"]["num_requests"] == 1 and doc["warmup"]["num_ok"] == 1
    assert len(doc["summary"]) == 2 == len(doc["levels"])
    for lv, n in zip(doc["levels"], (2, 4), strict=True):
        assert SUMMARY_KEYS <= lv["summary"].keys(), SUMMARY_KEYS - lv["summary"].keys()
        assert len(lv["requests"]) == n
        for r in lv["requests"]:
            assert RECORD_KEYS <= r.keys()
            assert r["ok"] and r["output_tokens"] == 16 and r["prompt_tokens_expected"] == 32
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_flaky_server_exit_0_and_errors_reported(fresh_server: FakeOpenAIServer, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flaky.json"
    rc = _bench(fresh_server.base("flaky"), "--concurrency", "1", "--num-requests", "9", "--out", str(out))
    assert rc == 0  # some requests succeeded
    text = capsys.readouterr().out
    assert "http_500 x3" in text and "malformed x1" in text
    assert "APPROXIMATE" in text  # no tokenizer: said so
    assert json.loads(out.read_text())["summary"][0]["errors_by_kind"] == {"http_500": 3, "malformed": 1}


def test_unreachable_url_exits_1_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.perf_counter()
    rc = _bench(f"http://127.0.0.1:{free_port()}", "--concurrency", "1,4", "--num-requests", "2,4",
                "--warmup", "1")
    assert rc == 1 and time.perf_counter() - t0 < 10
    captured = capsys.readouterr()
    assert "connect x2" in captured.out and "connect x4" in captured.out
    assert "model='default'" in captured.out
    assert "every measured request failed" in captured.err


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench("http://127.0.0.1:9", "--concurrency", "1", "--request-rate", "2") == 2
    assert _bench("http://127.0.0.1:9", "--workload", "chat", "--dataset", str(tmp_path / "nope.jsonl")) == 2
    assert _bench("http://127.0.0.1:9", "--concurrency", "1,2", "--num-requests", "1,2,3") == 2
    assert cli.main(["compare", str(tmp_path / "missing.json"), str(tmp_path / "other.json")]) == 2
    assert "error" in capsys.readouterr().err


def test_compare_two_real_runs_via_llmserve_cli(fake_server: FakeOpenAIServer, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "paced.json", tmp_path / "fast.json"
    assert _bench(fake_server.base("paced"), "--concurrency", "1,2", "--num-requests", "2,2", "--out", str(a)) == 0
    assert _bench(fake_server.base("fast"), "--concurrency", "1,2", "--num-requests", "2,2", "--out", str(b)) == 0
    capsys.readouterr()
    # the real command line: `llmserve bench compare a.json b.json` (python -m llmserve.cli)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "llmserve.cli", "bench", "compare", str(a), str(b)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("b/a" in ln for ln in lines)
    tok = [ln for ln in lines if "out tok/s" in ln]
    assert len(tok) == 2  # one per level
    ratio = float(tok[0].split()[-1].rstrip("x"))
    assert ratio > 3  # fast: 8 tokens in ~25 ms vs paced: 16 tokens in ~400 ms
    ttft = [ln for ln in lines if "TTFT p50" in ln]
    assert float(ttft[0].split()[-1].rstrip("x")) < 0.5
    assert cli.main(["compare", "--markdown", str(a), str(b)]) == 0
    md = capsys.readouterr().out
    assert "| level | metric |" in md and "b/a" in md


def test_bench_modules_import_no_engine_nor_torch() -> None:
    """`llmserve bench` must talk HTTP only: no engine, no torch, at import time or otherwise."""
    banned = ("torch", "llmserve.engine", "llmserve.layers", "llmserve.loader", "llmserve.models",
              "llmserve.server", "llmserve.llm", "llmserve.kv_cache")
    for path in (ROOT / "llmserve" / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not any(name == b or name.startswith(b + ".") for b in banned), f"{path.name}: {name}"
