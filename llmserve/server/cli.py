"""`llmserve serve [MODEL]`: the flags (vLLM's names where vLLM has the same flag) and the uvicorn run.

SIGTERM/SIGINT: stop accepting (new /v1 requests answer 503, /health too), let open responses
finish for up to --shutdown-timeout seconds, stop the engine, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType

import uvicorn

from llmserve.config import add_engine_arguments, engine_config_from_args
from llmserve.server.config import ServerConfig

API_KEY_ENV = "LLMSERVE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="registered name, GGUF file or Hugging Face directory (default: smollm2-135m)")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the same as the positional MODEL")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) clients may use in 'model'; a response reports the name its request used "
                        "(the first when it gave none), and /v1/models lists them all (default: the model's own "
                        "name)")
    net = parser.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, local only)")
    net.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    net.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on /v1 routes and the API docs (/docs, "
                     f"/openapi.json, /redoc); /health, /metrics and /version stay open (default: env {API_KEY_ENV}, "
                     "else no key)")
    net.add_argument("--max-request-body-bytes", type=int, default=ServerConfig.max_request_body_bytes,
                     help="larger request bodies get 413 (default: %(default)s)")
    net.add_argument("--max-queued-requests", type=int, default=None,
                     help="sequences (prompts × n) allowed to wait for a batch slot; beyond, 429 with Retry-After, "
                     "and 400 for one request that needs more than this at once (default: unbounded)")
    net.add_argument("--max-tokens-default", type=int, default=ServerConfig.max_tokens_default,
                     help="output tokens of a request that does not set max_tokens (chat, or completions with "
                     "max_tokens null), at most what the context leaves; 0: up to the context's end, as vLLM "
                     "(default: %(default)s)")
    net.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                     help="CORS: browser origins allowed to call the API, e.g. https://app.example.com, or '*' "
                     "(default: none, CORS off)")
    net.add_argument("--request-timeout", type=float, default=ServerConfig.request_timeout,
                     help="seconds a client has to send a request's headers, and as many again for its body; "
                     "else 408 and the connection closes (default: %(default)s)")
    net.add_argument("--max-connections", type=int, default=ServerConfig.max_connections,
                     help="open HTTP connections; requests on connections past this get 503 with Retry-After "
                     "(default: %(default)s)")
    net.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout,
                     help="seconds running requests may take to finish after SIGTERM; then those still open end "
                     "(a stream with an error event and [DONE], others 503) (default: %(default)s)")
    net.add_argument("--role", default="both", choices=("prefill", "decode", "both"),
                     help="disaggregated serving: prefill (prompts' KV pulled by decode instances), decode (pulls a "
                     "prompt's KV from the prefill instance a request names), or both (default); see "
                     "docs/deployment.md")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="log level (default: %(default)s)")
    net.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    net.add_argument("--log-stats-interval", type=float, default=10.0,
                     help="seconds between engine stats lines: throughput, queue, KV usage, prefix-cache hit "
                     "rate, preemptions (default: %(default)s)")
    add_engine_arguments(parser.add_argument_group("engine (also the keywords of LLM(...))"))
    ray = parser.add_argument_group("replicas on Ray Serve (pip install 'llmserve[ray]'; llmserve/ray.py)")
    ray.add_argument("--replicas", type=int, default=None,
                     help="run N replicas as a Ray Serve deployment behind Ray Serve's router on --host/--port "
                     "(with --max-replicas: the starting count of an autoscaled deployment)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default: 1)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="autoscaling: most replicas (autoscaling is on when this is given)")
    ray.add_argument("--target-ongoing-requests", type=float, default=8.0,
                     help="autoscaling: requests in flight per replica Ray Serve scales to hold (default: "
                     "%(default)s)")
    ray.add_argument("--cpus-per-replica", type=int, default=1,
                     help="Ray CPUs each replica reserves, and its engine's threads (default: %(default)s)")
    ray.add_argument("--ray-address", default="local",
                     help="'local' starts a Ray cluster on this machine; 'auto' or an address joins one "
                     "(default: %(default)s)")


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's config from parsed `add_arguments` flags. ValueError on a bad one."""
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    engine = engine_config_from_args(args, model=args.model or args.model_flag)
    if args.max_tokens_default < 0:
        raise ValueError(f"max_tokens_default must be >= 0 (0: no cap), got {args.max_tokens_default}")
    return ServerConfig(
        engine=engine,
        served_model_names=args.served_model_name,
        max_queued_requests=args.max_queued_requests,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes,
        request_timeout=args.request_timeout,
        max_connections=args.max_connections,
        max_tokens_default=args.max_tokens_default or None,
        allowed_origins=args.allowed_origins,
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=args.log_stats_interval,
        role=args.role,
        url=f"http://{args.host}:{args.port}",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        config = server_config(args)
        on_ray = args.replicas is not None or args.max_replicas is not None
        if on_ray:
            from llmserve.ray import replica_config

            replicas = replica_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if on_ray:
        from llmserve.ray import serve_on_ray

        return serve_on_ray(config, replicas, args.ray_address, args.host, args.port)
    try:  # the port first: a port in use fails now, not after the model has loaded
        sock = _listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {config.url}: {e.strerror or e}", file=sys.stderr)
        return 1
    _allow_open_files(args.max_connections)
    from llmserve.server.app import create_app  # the engine and torch: after the port check
    from llmserve.server.http_protocol import limited_http_protocol

    failed: list[BaseException] = []
    server: _Server | None = None

    def on_engine_failure(e: BaseException) -> None:  # the model failed to load, or the engine stopped for good
        failed.append(e)
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_engine_failure)
    state = app.state.server
    protocol = limited_http_protocol(config.request_timeout, config.max_connections)
    uv_config = uvicorn.Config(app, http=protocol, log_level=args.log_level, access_log=not args.no_access_log,
                               timeout_graceful_shutdown=args.shutdown_timeout + FLUSH_GRACE_S,
                               log_config=None)  # keep our logging set-up
    server = _Server(uv_config, on_signal=lambda: setattr(state, "draining", True),
                     deadline=(args.shutdown_timeout, state.end_open_requests))
    if config.api_key:
        logging.getLogger(__name__).info("API key required on /v1 routes and the API docs")
    server.run(sockets=[sock])
    return 1 if failed else 0


# Seconds between ending the requests still open at the shutdown deadline and uvicorn closing their
# connections: time for their last events to reach the clients.
FLUSH_GRACE_S = 5.0


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, as uvicorn would open it (it is handed the socket)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _allow_open_files(max_connections: int) -> None:
    """Raise the soft limit on open files to fit max_connections (as vLLM raises it), if the hard limit lets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + 256  # the model, the kernels, logs
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            logging.getLogger(__name__).warning("open-file limit %d is below --max-connections %d + 256", new,
                                                max_connections)


class _Server(uvicorn.Server):
    """uvicorn's Server, told when a stop signal arrives, ending what is still open at the shutdown
    deadline, and exiting 0 after a graceful stop.

    uvicorn waits for open responses up to its graceful-shutdown timeout, then cancels them, which cuts
    a stream mid-body (no finish, no [DONE], broken chunked encoding). So at our deadline, a few seconds
    before uvicorn's, `deadline`'s callback ends the requests still open, and each response ends as the
    API says. (uvicorn re-raises the signal once it has shut down, which would end the process with -15.)
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None],
                 deadline: tuple[float, Callable[[], Awaitable[None]]]) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._deadline = deadline

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        seconds, end_open_requests = self._deadline

        async def at_deadline() -> None:
            await asyncio.sleep(seconds)
            await end_open_requests()

        ender = asyncio.create_task(at_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
