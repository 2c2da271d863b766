"""Real processes for the gateway's tests: `llmserve serve` replicas, redis-server, `llmserve gateway`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerProcess

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A throwaway redis-server: no persistence to disk, its own port."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.folder = folder
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class GatewayProcess:
    """`llmserve gateway --config FILE` in a subprocess, ready once /health answers."""

    def __init__(self, folder: Path, config: dict[str, Any], *args: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        folder.mkdir(parents=True, exist_ok=True)
        self.config_path = folder / f"gateway-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.admin_headers = {"Authorization": f"Bearer {config['admin_key']}"} if config.get("admin_key") else {}
        self.log_path = folder / f"gateway-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "llmserve.cli", "gateway", "--config", str(self.config_path), "--port",
               str(self.port), "--no-access-log", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=5).status_code in (200, 503):
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"gateway not up:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """llmserve:gateway_* samples, keyed by name and labels."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.base}/metrics", timeout=10,
                                                                        headers=self.admin_headers).text):
            for s in family.samples:
                if s.name.startswith("llmserve:gateway_"):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def total(self, name: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> list[ServerProcess]:
    """Two real replicas of the default model, shared by the gateway tests."""
    folder = tmp_path_factory.mktemp("replicas")
    procs = [ServerProcess(folder / f"replica{i}.log") for i in range(2)]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> RedisProcess:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    proc = RedisProcess(tmp_path)
    yield proc
    proc.stop()


def gateway_config(urls: list[str], **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"models": {MODEL: {"upstreams": urls, "balancing": extra.pop("balancing",
                                                                                          "least_outstanding")}},
                              "health": {"interval": 0.5, "timeout": 2.0}}
    config.update(extra)
    return config
