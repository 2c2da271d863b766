"""Replicas on Ray Serve (`llmserve serve --replicas 2`, a local Ray cluster on this machine): both replicas
serve, a killed replica is restarted by Ray while the traffic routes around it, /health and /metrics stay
reachable, and SIGTERM stops everything Ray started."""

from __future__ import annotations

import argparse
import time

import httpx
import openai
import psutil
import pytest

pytest.importorskip("ray.serve", reason="the Ray extra is not installed (pip install 'llmserve[ray]'; CI does)")

from llmserve.ray import REPLICA_HEADER, ReplicaConfig, replica_config  # noqa: E402
from tests.server.conftest import MODEL, ServerProcess  # noqa: E402


def _replica_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if "ServeReplica:llmserve:llmserve" in " ".join(p.info["cmdline"] or [])]


def _ask(client: openai.OpenAI) -> str:
    """One greedy completion; returns the replica that answered."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                      temperature=0)
    assert raw.parse().choices[0].text
    return raw.headers[REPLICA_HEADER]


@pytest.mark.processes
def test_two_replicas_serve_and_a_killed_one_is_replaced(tmp_path):
    server = ServerProcess(tmp_path / "ray.log", "--replicas", "2", "--cpus-per-replica", "1")
    try:
        server.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="-", max_retries=0)
        first = {_ask(client) for _ in range(12)}
        assert len(first) == 2, first
        victim = _replica_processes()[0]
        victim.kill()
        victim.wait(10)
        for _ in range(8):  # the traffic routes around the dead replica
            assert _ask(client) in first
            assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
            assert "llmserve:num_requests_running" in httpx.get(f"{server.base}/metrics", timeout=10).text
        deadline = time.monotonic() + 180
        answered = set()
        while time.monotonic() < deadline and not answered - first:  # Ray starts a replacement, which serves
            answered.add(_ask(client))
            time.sleep(0.5)
        assert answered - first, f"no new replica answered within 180 s: {answered}"
        assert len(_replica_processes()) == 2
    finally:
        code = server.stop()
    assert code == 0, server.log_path.read_text()[-3000:]
    time.sleep(2)
    assert not _replica_processes()


@pytest.mark.parametrize(("flags", "expected"), [
    (["--replicas", "3"], ReplicaConfig(3, 3, 3)),
    (["--max-replicas", "4"], ReplicaConfig(1, 1, 4)),
    (["--replicas", "2", "--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "2"],
     ReplicaConfig(2, 1, 4, 2.0)),
])
def test_replica_flags(flags, expected):
    from llmserve.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = replica_config(parser.parse_args(flags))
    assert config == expected
    assert config.autoscaling == (expected.max_replicas > expected.min_replicas)


def test_impossible_replica_counts_are_refused():
    with pytest.raises(ValueError, match="1 <= min"):
        ReplicaConfig(num_replicas=5, min_replicas=1, max_replicas=4)
