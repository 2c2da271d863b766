"""Replicas on Ray Serve: N llmserve engines as one Ray Serve deployment, autoscaled, behind Ray's router.

Why Ray Serve: past one process we ride an existing engine, not a cluster layer of our own. Each replica
is a Ray actor running the same FastAPI app `llmserve serve` runs (routes, errors, streaming, /metrics),
with its model loaded before Ray routes to it. Ray Serve's proxy balances requests over the replicas
(it picks the less loaded of two), restarts a replica that dies or whose health check fails (ours: the
model loaded and the engine stepping), and scales the count between a minimum and a maximum to hold a
target of requests in flight per replica. Our gateway can front the deployment as one upstream (Ray's
proxy address) for its caches, routing and cost accounting.

    pip install 'llmserve[ray]'
    llmserve serve MODEL --replicas 2                                 # a local Ray cluster, 2 replicas
    llmserve serve MODEL --min-replicas 1 --max-replicas 4 --ray-address auto   # join a running cluster
    serve run llmserve.ray:build_app model=MODEL max_replicas=4       # Ray's own CLI (keys: serve's flags)
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from dataclasses import dataclass

from llmserve.server.config import ServerConfig

logger = logging.getLogger(__name__)

DEPLOYMENT = "llmserve"
REPLICA_HEADER = "x-llmserve-replica"  # which replica answered (Ray Serve's replica id)


@dataclass(frozen=True)
class ReplicaConfig:
    """How many replicas, and what each reserves. Autoscaling when max_replicas > min_replicas."""

    num_replicas: int = 1  # the starting count
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 8.0  # requests in flight per replica that autoscaling holds
    cpus_per_replica: int = 1  # Ray CPUs reserved, and the engine's torch threads

    def __post_init__(self) -> None:
        if self.cpus_per_replica < 1:
            raise ValueError(f"cpus_per_replica must be >= 1, got {self.cpus_per_replica}")
        if not 1 <= self.min_replicas <= self.num_replicas <= self.max_replicas:
            raise ValueError(f"replicas must satisfy 1 <= min ({self.min_replicas}) <= start ({self.num_replicas}) "
                             f"<= max ({self.max_replicas})")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas > self.min_replicas


def replica_config(args: argparse.Namespace) -> ReplicaConfig:
    """From `llmserve serve`'s flags: --replicas N alone is N fixed replicas; --max-replicas turns on
    autoscaling from --min-replicas (default 1), starting at --replicas (default the minimum)."""
    low = args.min_replicas or 1
    high = args.max_replicas if args.max_replicas is not None else (args.replicas or low)
    start = args.replicas if args.replicas is not None else low
    if args.max_replicas is None:
        low = high = start
    return ReplicaConfig(start, low, high, args.target_ongoing_requests, args.cpus_per_replica)


def deployment(config: ServerConfig, replicas: ReplicaConfig):
    """The Ray Serve application: llmserve's app in each replica, loaded before it takes traffic."""
    from ray import serve

    threads = replicas.cpus_per_replica

    def make_app():  # runs in each replica's process
        import torch

        from llmserve.server.app import create_app

        torch.set_num_threads(threads)
        app = create_app(config, load_first=True)
        app.add_middleware(_ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
        return app

    @serve.ingress(make_app)
    class LLMServeReplica:
        async def check_health(self) -> None:
            """Ray Serve calls this periodically; raising makes it replace the replica."""
            state = self.app.state.server
            if state.load_error is not None:
                raise RuntimeError(f"the model failed to load: {state.load_error}")
            if state.llm is not None and not state.llm.is_running:
                raise RuntimeError("the engine stopped")

    options = dict(name=DEPLOYMENT, ray_actor_options={"num_cpus": replicas.cpus_per_replica},
                   health_check_period_s=2.0, health_check_timeout_s=30.0)
    if replicas.autoscaling:
        options["autoscaling_config"] = {"min_replicas": replicas.min_replicas, "max_replicas": replicas.max_replicas,
                                         "initial_replicas": replicas.num_replicas,
                                         "target_ongoing_requests": replicas.target_ongoing_requests}
    else:
        options["num_replicas"] = replicas.num_replicas
    return serve.deployment(**options)(LLMServeReplica).bind()


def build_app(args: dict[str, str]):
    """Ray Serve's application builder (`serve run llmserve.ray:build_app model=... max_replicas=4`): the
    keys are `llmserve serve`'s flags without the dashes, the values their text."""
    from llmserve.server.cli import add_arguments, server_config

    argv = []
    for key, value in args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    parser = argparse.ArgumentParser(prog="llmserve.ray:build_app")
    add_arguments(parser)
    parsed = parser.parse_args(argv)
    return deployment(server_config(parsed), replica_config(parsed))


def serve_on_ray(config: ServerConfig, replicas: ReplicaConfig, address: str, host: str, port: int) -> int:
    """`llmserve serve --replicas ...`: start (or join) Ray, run the deployment with Ray Serve's HTTP proxy on
    host:port, wait for SIGTERM / SIGINT, then shut Serve down. Returns the exit code."""
    try:
        import ray
        from ray import serve
    except ImportError:
        logger.error("replicas need Ray Serve: pip install 'llmserve[ray]'")
        return 2
    ray.init(address=None if address == "local" else address, include_dashboard=False,
             runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("LLMSERVE_")}})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(config, replicas), name=DEPLOYMENT, route_prefix="/")
        scaling = (f"autoscaled {replicas.min_replicas}-{replicas.max_replicas}, target "
                   f"{replicas.target_ongoing_requests:g} requests in flight each" if replicas.autoscaling else "fixed")
        logger.info("serving on Ray Serve at http://%s:%d: %d replica(s) (%s), %d CPU(s) each", host, port,
                    replicas.num_replicas, scaling, replicas.cpus_per_replica)
        stop.wait()
        logger.info("stopping the Ray Serve deployment")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


class _ReplicaHeader:
    """Pure ASGI middleware: every response says which replica answered (streams untouched)."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return await self.app(scope, receive, send_with_header)
