"""benchmarks/bench_vs_peers.py drives a real server process end to end (a stand-in for `llmserve serve`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .helpers import ROOT, free_port


def test_bench_vs_peers_with_a_stand_in_server(tmp_path: Path) -> None:
    out = tmp_path / "results"
    port = free_port()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_vs_peers.py"), "--engines", "llmserve,vllm-cpu",
           "--llmserve-cmd", "{python} -m tests.bench.fake_server --port {port} --root-mode fast",
           "--llmserve-port", str(port), "--quick", "--peers-dir", str(tmp_path / "no-peers"),
           "--out-dir", str(out), "--ready-timeout", "30"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((out / "llmserve.json").read_text())
    assert [s["concurrency"] for s in doc["summary"]] == [1, 4]
    assert all(s["num_ok"] == s["num_requests"] for s in doc["summary"])
    assert doc["workload"]["name"] == "shared-prefix" and doc["server"]["startup_to_ready_s"] > 0
    assert doc["server"]["model"] == "fake-model"
    md = (out / "peers_comparison.md").read_text()
    assert "| llmserve | measured |" in md
    assert "vllm-cpu" in md and "not installed" in md  # absent peer: skipped, and said so
    if "recorded" in md:  # peerbench's recorded numbers are shown when shared/peers is present
        assert "Ratios to llmserve" in md
    assert (out / "peers_comparison.png").read_bytes()[:4] == b"\x89PNG"
    # the stand-in server was stopped (its port is free again)
    import socket

    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_another_model_reaches_every_engine(tmp_path: Path) -> None:
    """--model: llmserve serves the registered name; a peer is pointed at the model's own files (a missing
    one is named), and peerbench's SmolLM2 figures are not offered as a stand-in."""
    peers = tmp_path / "peers"
    gguf = peers / "models" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    (peers / "build" / "llamacpp-noamx" / "bin").mkdir(parents=True)
    (peers / "build" / "llamacpp-noamx" / "bin" / "llama-server").write_bytes(b"")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_vs_peers.py"), "--model", "qwen2.5-coder-1.5b",
           "--engines", "llmserve,llama-server-np32,vllm-cpu", "--peers-dir", str(peers), "--dry-run"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = {ln.split(":")[0]: ln for ln in proc.stdout.splitlines() if ln.startswith("[peers]")}
    assert "--model qwen2.5-coder-1.5b --served-model-name qwen2.5-coder-1.5b" in lines["[peers] llmserve"]
    assert f"-m {gguf} --alias qwen2.5-coder-1.5b" in lines["[peers] llama-server-np32"]
    assert "skipped" in lines["[peers] vllm-cpu"] and "models/qwen2.5-coder-1.5b-hf" in lines["[peers] vllm-cpu"]
    assert "recorded" not in proc.stdout
