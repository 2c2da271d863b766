"""Every script in benchmarks/ runs against today's code: each at its smallest size, as a subprocess.

The figures of these runs mean nothing (seconds, not minutes, on shared cores); what is checked is that each script
starts, measures through the engine, server, gateway or kernels it exists for, and writes the table or file it
promises. docs/performance.md has the real runs; benchmarks/README.md says how to run each script in full.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.kernels import native_quantized_kernels

pytestmark = pytest.mark.benchmark

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def run(script: str, *args: str, timeout: float = 240) -> str:
    """`python benchmarks/<script> <args>` from the repository root; its stdout, after asserting exit status 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (a script that starts a gateway takes port and port + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count < 65536 and all(_free(first + i) for i in range(count)):
            return first
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_bench_vs_peers(tmp_path: Path) -> None:
    """llmserve served and benched; a peer that is not installed is skipped, and the report says so."""
    out = run("bench_vs_peers.py", "--engines", "llmserve,llama-server-np32", "--levels", "1:2", "--warmup", "0",
              "--no-recorded", "--peers-dir", str(tmp_path / "no-peers"), "--llmserve-port", str(free_ports(1)),
              "--ready-timeout", "300", "--out-dir", str(tmp_path))
    doc = json.loads((tmp_path / "llmserve.json").read_text())
    assert [(s["concurrency"], s["num_ok"]) for s in doc["summary"]] == [(1, 2)]
    assert doc["server"]["startup_to_ready_s"] > 0 and doc["server"]["peak_tree_rss_mib"] > 0
    md = (tmp_path / "peers_comparison.md").read_text()
    assert "| llmserve | measured |" in md and "llama-server-np32" in md and "not installed" in md
    assert "llama-server-np32: skipped" in out


def test_bandwidth_ceiling(tmp_path: Path) -> None:
    """One stretch against the ceiling and, where the layers run as one native call, the piece split."""
    run("bandwidth_ceiling.py", "--steps", "2", "--repeats", "1", "--out", str(tmp_path / "ceiling.json"))
    doc = json.loads((tmp_path / "ceiling.json").read_text())
    assert len(doc["rows"]) == 1 and doc["rows"][0]["share"] > 0 and doc["host"]["weights_mb"] > 50
    pieces = {p["piece"] for p in doc["pieces"]}
    assert not pieces or {"attention", "q/k/v", "gate/up", "down"} <= pieces


def test_decode_step_configs() -> None:
    out = run("decode_step_configs.py", "--config", "default=", "--batches", "1,2", "--steps", "2", "--repeats", "1")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(float(row[2]) > 0 for row in rows)


def test_quantized_gemv() -> None:
    """The native products against PyTorch's, and the AMX int8 x int8 kernel against oneDNN's where there is AMX."""
    out = run("quantized_gemv.py", "--layers", "1", "--tokens", "1", "--rounds", "1")
    assert "| 1 | int4 layers |" in out and "| 1 | int8 head |" in out
    out = run("quantized_gemv.py", "--amx-int8", "--layers", "1", "--tokens", "17", "--rounds", "1")
    assert "| 17 |" in out or out.startswith("skipped: this machine has no AMX")


def test_kv_cache_quant(tmp_path: Path) -> None:
    """The int8 cache alone (one engine): the kernel on every format asked for, the engine's decode rate."""
    run("kv_cache_quant.py", "--contexts", "160", "192", "--output-len", "8", "--rounds", "1", "--formats", "int8",
        "--repeats", "2", "--out", str(tmp_path / "kv"))
    doc = json.loads((tmp_path / "kv.json").read_text())
    assert set(doc["engine"]) == set(doc["kernel"]) == {"int8"} and doc["engine"]["int8"]["decode_tok_s"] > 0
    assert doc["engine"]["int8"]["kv_tokens"] > 0 and "| int8 |" in (tmp_path / "kv.md").read_text()


def test_int4_methods(tmp_path: Path) -> None:
    """Round to nearest alone on SmolLM2's groups of 32, beside the unquantized model: quantized, written, read and
    scored."""
    run("int4_methods.py", "--methods", "int4", "--ppl-tokens", "256", "--out", str(tmp_path / "m"))
    doc = json.loads((tmp_path / "m.json").read_text())
    (base, rtn) = doc["rows"]
    assert base["method"] == "unquantized" and rtn["method"] == "int4" and rtn["seconds"] > 0
    assert rtn["perplexity"] > base["perplexity"] > 1
    assert "| round to nearest | 32 |" in (tmp_path / "m.md").read_text()


def test_spec_decode(tmp_path: Path) -> None:
    """One server (speculation off) through the script's serve, bench and report path."""
    run("spec_decode.py", "--workloads", "chat", "--levels", "1:1", "--output-len", "8", "--warmup", "0",
        "--no-ngram", "--port", str(free_ports(1)), "--out-dir", str(tmp_path))
    doc = json.loads((tmp_path / "spec_off_chat.json").read_text())
    assert doc["summary"][0]["num_ok"] == 1
    assert "## chat" in (tmp_path / "spec_decode.md").read_text()
    assert (tmp_path / "spec_decode_chat.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_validation(tmp_path: Path) -> None:
    """The fit and the predictions from a recorded run's bench files (`--reuse`: no server)."""
    recorded = BENCH / "results" / "plan-validation" / "zen5"
    for f in recorded.glob("plan_validation_*.json"):
        shutil.copy(f, tmp_path / f.name)
    run("plan_validation.py", "--reuse", "--seeds", "2", "--out-dir", str(tmp_path))
    doc = json.loads((tmp_path / "plan_validation.json").read_text())
    assert len(doc["comparison"]) == 3 and all(row["measured"]["ttft_p50_ms"] > 0 for row in doc["comparison"])
    assert "| rate req/s |" in (tmp_path / "plan_validation.md").read_text()
    assert (tmp_path / "plan_validation.png").is_file()


def test_gateway(tmp_path: Path) -> None:
    """A replica behind the gateway (paired TTFT, ABBA throughput), the cache threshold and the routers."""
    out = run("gateway.py", "--parts", "overhead,threshold,routing", "--smoke", "--port", str(free_ports(2)),
              "--routing-dir", str(BENCH / "results" / "gateway"), "--out-dir", str(tmp_path), timeout=300)
    assert "TTFT added by the gateway, per pair" in (tmp_path / "overhead.md").read_text()
    assert "| 0.97 |" in (tmp_path / "threshold.md").read_text()
    assert "| learned |" in (tmp_path / "routing.md").read_text() and "| length |" in out


def test_gateway_soak(tmp_path: Path) -> None:
    """Two replicas and Redis behind the gateway, with Redis stopped and a replica killed mid-run: every request
    that had not started streaming is answered, and nothing is left outstanding at the end."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    run("gateway_soak.py", "--minutes", "0.5", "--smoke", "--port", str(free_ports(4)), "--out-dir", str(tmp_path),
        timeout=300)
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert doc["outcomes"]["ok"] > 0 and "failed_before_stream" not in doc["outcomes"], doc["outcomes"]
    assert doc["end"]["outstanding"] == 0 and [e["event"] for e in doc["events"]][-1] == "replica 1 ready again"
    assert (tmp_path / "soak.png").is_file() and "| total |" in (tmp_path / "soak.md").read_text()


def test_structured_outputs(tmp_path: Path) -> None:
    run("structured_outputs.py", "--parts", "masks", "--tokenizers", "smollm2-135m", "--schemas", "plain",
        "--out-dir", str(tmp_path))
    record = json.loads((tmp_path / "masks.json").read_text())
    assert set(record) == {f"smollm2-135m/plain/{b}" for b in (1, 8, 32)}
    assert all(r["masks_us"] > 0 and r["apply_us"] > 0 for r in record.values())


def test_device_throughput(tmp_path: Path) -> None:
    """A registered-shape model built with random weights, on the CPU (a GPU run is the same path)."""
    run("device_throughput.py", "--device", "cpu", "--shapes", "tiny", "--concurrency", "1", "--tokens", "4",
        "--modes", "default", "--out", str(tmp_path / "device.json"))
    rows = json.loads((tmp_path / "device.json").read_text())
    assert len(rows) == 1 and rows[0]["shape"] == "tiny" and rows[0]["out_tok_s"] > 0


def test_moe_decode(tmp_path: Path) -> None:
    """A tiny Mixtral and the dense Llama of its active size, built here, alternated as loaded and under int4 (each
    also layer by layer); the experts a step runs are counted."""
    run("moe_decode.py", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--experts", "4",
        "--expert-intermediate", "32", "--output-len", "4", "--concurrency", "1", "2", "--rounds", "1",
        "--out-dir", str(tmp_path))
    doc = json.loads((tmp_path / "decode.json").read_text())
    assert [(r["quantization"], r["concurrency"]) for r in doc["rows"]] == [("auto", 1), ("auto", 2), ("int4", 1),
                                                                            ("int4", 2)]
    assert all(r["moe_tok_s"] > 0 and r["dense_tok_s"] > 0 for r in doc["rows"])
    assert doc["rows"][0]["experts_run_per_layer"] == 2  # top-2 of one token
    moe, dense = doc["models"]["moe"], doc["models"]["dense"]
    assert moe["params_active"] == dense["params_active"] + 2 * 4 * 64  # the same, but for the routers' rows
    if native_quantized_kernels():  # both models' int4 decode steps as one native call, and each layer by layer
        assert moe["plans"]["int4"]["decode_steps"] == dense["plans"]["int4"]["decode_steps"] == "one native call"
        assert doc["rows"][2]["moe-layered_tok_s"] > 0 and doc["rows"][2]["dense-layered_tok_s"] > 0
    assert "| int4 | 1 |" in (tmp_path / "decode.md").read_text()
    assert (tmp_path / "decode.png").read_bytes()[:4] == b"\x89PNG"
