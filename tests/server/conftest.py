"""Real servers for the HTTP tests: `llmserve serve` in a subprocess on a free port, one per scope.

Small KV cache and context so start-up stays quick; float32 so greedy text is reproducible.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m"
COMMON_ARGS = ["--kv-cache-memory-gb", "0.25", "--max-model-len", "2048", "--dtype", "float32", "--quantization",
               "none", "--no-access-log", "--log-stats-interval", "0.5"]


class ServerProcess:
    """One `llmserve serve` subprocess: start, wait until /health says 200, read /metrics, stop."""

    def __init__(self, log_path: Path, *args: str | Path, program: Sequence[str | Path] = (sys.executable, "-m",
                 "llmserve.cli"), common: Sequence[str] = COMMON_ARGS, cwd: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [*map(str, program), "serve", "--port", str(self.port), *common, *map(str, args)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("LLMSERVE_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        self.health_statuses: list[int] = []  # what /health answered while we waited

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status = httpx.get(f"{self.base}/health", timeout=5).status_code
                self.health_statuses.append(status)
                if status == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """llmserve:* samples by name (summed over labels)."""
        text = httpx.get(f"{self.base}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("llmserve:"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free; fails after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["llmserve:num_requests_running"] == 0 and m["llmserve:num_requests_waiting"] == 0
                    and m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """The default server, shared by every test that does not need special flags."""
    proc = ServerProcess(tmp_path_factory.mktemp("server") / "server.log", "--served-model-name", MODEL, "alias")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
