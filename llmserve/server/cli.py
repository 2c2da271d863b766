"""`llmserve serve [MODEL]`: the flags (vLLM's names where vLLM has the same flag) and the uvicorn run.

SIGTERM/SIGINT: stop accepting (new /v1 requests answer 503, /health too), let open responses
finish for up to --shutdown-timeout seconds, stop the engine, exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from llmserve.config import KERNEL_CHOICES, QUANTIZATION_METHODS, SchedulerConfig

API_KEY_ENV = "LLMSERVE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="registered name, GGUF file or Hugging Face directory (default: smollm2-135m)")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the same as the positional MODEL")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) clients use in 'model'; the first is reported back "
                        "(default: the model's own name)")
    net = parser.add_argument_group("HTTP")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, local only)")
    net.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    net.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: env {API_KEY_ENV}, "
                     "else no key)")
    net.add_argument("--max-request-body-bytes", type=int, default=1 << 20,
                     help="larger request bodies get 413 (default: %(default)s)")
    net.add_argument("--max-queued-requests", type=int, default=None,
                     help="requests allowed to wait for a batch slot; beyond, 429 with Retry-After "
                     "(default: unbounded)")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds running requests may take to finish after SIGTERM (default: %(default)s)")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="log level (default: %(default)s)")
    net.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    net.add_argument("--log-stats-interval", type=float, default=10.0,
                     help="seconds between engine stats lines: throughput, queue, KV usage, prefix-cache hit "
                     "rate, preemptions (default: %(default)s)")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="weight and activation dtype (default: auto: bfloat16 where the CPU has it natively)")
    eng.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                     help="weight-only quantization of the linear layers, used for steps of few tokens "
                          "(CPU; default: none, the weights as loaded)")
    eng.add_argument("--int8-activations", action="store_true",
                     help="with --quantization: steps of many tokens (batches, prompts) multiply int8 activations "
                     "by SmoothQuant-smoothed int8 weights, calibrated at start: ~1.7x faster matmuls there")
    eng.add_argument("--compile", action="store_true",
                     help="torch.compile decode steps as one graph (native attention) or each decoder layer (torch "
                     "attention): faster steps for ~1-2 min more start-up")
    eng.add_argument("--attention-backend", default="auto", choices=list(KERNEL_CHOICES),
                     help="decode attention: native (the C++ CPU kernel), torch (PyTorch ops), or auto: native "
                     "on CPU where it builds (default: %(default)s)")
    eng.add_argument("--quantized-kernels", default="auto", choices=list(KERNEL_CHOICES),
                     help="with --quantization, the kernels of steps of few tokens: native (llmserve's, AVX-512 "
                     "VNNI), torch (PyTorch's), or auto: native where it builds vectorized; with --int8-activations, "
                     "not torch also runs the int8 products on llmserve's AMX kernel where the CPU has AMX "
                     "(default: %(default)s)")
    eng.add_argument("--elementwise-kernels", default="auto", choices=list(KERNEL_CHOICES),
                     help="the decoder layers' norms, rotary and SwiGLU gate in eager steps (prompts, mixed steps) "
                     "and greedy sampling's argmax: native (llmserve's fused CPU kernels), torch (PyTorch's ops), "
                     "or auto: native where they build (the layers in bfloat16 only) (default: %(default)s)")
    eng.add_argument("--max-model-len", type=int, default=None,
                     help="longest prompt + output in tokens (default: the model's context length)")
    eng.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch (default: %(default)s)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                     help="tokens per engine step: decodes first, then prompt chunks (default: %(default)s)")
    eng.add_argument("--long-prefill-token-threshold", type=int,
                     default=SchedulerConfig.long_prefill_token_threshold,
                     help="largest prompt chunk one request runs per step; longer prompts are prefilled over "
                     "several steps so running streams keep flowing (default: %(default)s)")
    eng.add_argument("--max-long-partial-prefills", type=int, default=SchedulerConfig.max_long_partial_prefills,
                     help="prompts longer than the threshold prefilled at once; shorter prompts pass the others "
                     "(default: %(default)s)")
    eng.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                     help="do not reuse the KV blocks of shared prompt prefixes (on by default)")
    eng.add_argument("--kv-cache-memory-gb", type=float, default=None,
                     help="KV cache size in GiB (default: --kv-cache-memory-fraction of free memory)")
    eng.add_argument("--kv-cache-memory-fraction", type=float, default=0.1,
                     help="KV cache size as a fraction of the memory free at start (default: %(default)s)")
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default: %(default)s)")
    eng.add_argument("--seed", type=int, default=0, help="engine random seed (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from llmserve.config import CacheConfig, EngineConfig, ModelConfig
    from llmserve.server.app import ServerConfig, create_app

    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        print(f"error: two models given: {args.model!r} and --model {args.model_flag!r}", file=sys.stderr)
        return 2
    try:
        engine = EngineConfig(
            model=ModelConfig(model=args.model or args.model_flag, dtype=args.dtype, quantization=args.quantization,
                              int8_activations=args.int8_activations, compile=args.compile,
                              attention_backend=args.attention_backend, quantized_kernels=args.quantized_kernels,
                              elementwise_kernels=args.elementwise_kernels,
                              max_model_len=args.max_model_len, seed=args.seed),
            cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_memory_gb,
                              kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                              enable_prefix_caching=args.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      long_prefill_token_threshold=args.long_prefill_token_threshold,
                                      max_long_partial_prefills=args.max_long_partial_prefills),
        )
        if args.max_queued_requests is not None and args.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {args.max_queued_requests}")
        if args.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {args.max_request_body_bytes}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = ServerConfig(
        engine=engine,
        served_model_names=args.served_model_name,
        max_queued_requests=args.max_queued_requests,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        log_stats_interval=args.log_stats_interval,
        url=f"http://{args.host}:{args.port}",
    )
    failed: list[BaseException] = []
    server: _Server | None = None

    def on_load_failure(e: BaseException) -> None:
        failed.append(e)
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_load_failure)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                               access_log=not args.no_access_log, timeout_graceful_shutdown=args.shutdown_timeout,
                               log_config=None)  # keep our logging set-up
    server = _Server(uv_config, on_signal=lambda: setattr(app.state.server, "draining", True))
    if config.api_key:
        logging.getLogger(__name__).info("API key required on /v1 routes")
    server.run()
    return 1 if failed else 0


class _Server(uvicorn.Server):
    """uvicorn's Server, told when a stop signal arrives, and exiting 0 after a graceful stop.

    (uvicorn re-raises the signal once it has shut down, which would end the process with -15.)
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
