"""Prometheus metrics with vLLM's names under an `llmserve:` prefix, in a registry of the app's own.

Engine state (running/waiting requests, KV blocks, token and preemption totals) is read from
`AsyncLLM.stats()` when scraped, so it can never drift from the engine; per-request latencies are
observed by a `RequestTracker` as outputs arrive. One registry per app (never the process-global
default) lets several apps, e.g. in tests, live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmserve.engine.async_engine import ServingStats
from llmserve.outputs import RequestOutput

PREFIX = "llmserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's, so dashboards built for it read ours.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The app's metrics. `bind(model_name)` once the engine is loaded; `render()` for /metrics."""

    def __init__(self, stats: Callable[[], ServingStats | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model_name: str | None = None
        labels = ["model_name"]
        self._ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time from arrival to the first token.",
                               labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self._itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between consecutive output tokens.",
                              labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self._e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Time from arrival to the last token.",
                              labels, buckets=_REQUEST_BUCKETS, registry=self.registry)
        self._queue = Histogram(f"{PREFIX}request_queue_time_seconds",
                                "Time a request waited before it was first scheduled.",
                                labels, buckets=_REQUEST_BUCKETS, registry=self.registry)
        self._success = Counter(f"{PREFIX}request_success", "Engine requests finished, by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._failure = Counter(f"{PREFIX}request_failure", "Engine requests that ended in an error, by kind "
                                "(constraint: the output constraint failed while decoding; engine: a step failed).",
                                labels + ["reason"], registry=self.registry)
        # disaggregated prefill/decode (server/kv_transfer.py): blocks sent and received, pulls that failed (their
        # prompts computed here instead), and each pull's time
        self._kv_blocks = Counter(f"{PREFIX}kv_transfer_blocks", "KV blocks moved between instances, by direction "
                                  "(export: sent to a decode instance; import: written here from a prefill one).",
                                  labels + ["direction"], registry=self.registry)
        self._kv_failures = Counter(f"{PREFIX}kv_transfer_failures", "KV pulls that failed (the prompt was computed "
                                    "here instead), by reason.", labels + ["reason"], registry=self.registry)
        self._kv_seconds = Histogram(f"{PREFIX}kv_transfer_seconds", "Time of one KV pull: request, transfer and "
                                     "the write into the cache.", labels, buckets=_TTFT_BUCKETS,
                                     registry=self.registry)
        self.registry.register(_EngineCollector(stats, lambda: self._model_name))

    def bind(self, model_name: str) -> None:
        self._model_name = model_name
        self.ttft = self._ttft.labels(model_name)
        self.itl = self._itl.labels(model_name)
        self.e2e = self._e2e.labels(model_name)
        self.queue = self._queue.labels(model_name)
        for reason in ("stop", "length"):  # present at 0 from the start, so rate() works at once
            self._success.labels(model_name, reason)
        for reason in ("constraint", "engine"):
            self._failure.labels(model_name, reason)
        for direction in ("export", "import"):
            self._kv_blocks.labels(model_name, direction)

    def kv_blocks(self, direction: str, count: int) -> None:
        self._kv_blocks.labels(self._model_name, direction).inc(count)

    def kv_pull(self, seconds: float, failure: str | None = None) -> None:
        """A KV pull's time, and why it failed (None: it did not)."""
        self._kv_seconds.labels(self._model_name).observe(seconds)
        if failure is not None:
            self._kv_failures.labels(self._model_name, failure).inc()

    def success(self, finish_reason: str) -> None:
        self._success.labels(self._model_name, finish_reason).inc()

    def failure(self, reason: str) -> None:
        self._failure.labels(self._model_name, reason).inc()

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        """Prometheus text. Takes the engine lock (via stats()), so call it off the event loop."""
        return generate_latest(self.registry)


class RequestTracker:
    """Latencies of one engine request, observed from its stream of cumulative outputs."""

    __slots__ = ("_metrics", "_last")

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last: float | None = None

    def observe(self, out: RequestOutput) -> None:
        """Called on the event loop for every streamed token: the common case (a later token, not the
        last) is one clock read and one histogram observation."""
        now = time.monotonic()  # the engine stamps its times with the same clock
        last, self._last = self._last, now
        if last is not None and not out.finished:
            self._metrics.itl.observe(now - last)
            return
        m = self._metrics
        arrival = out.metrics.get("arrival_time", now)
        if last is None:
            m.ttft.observe(out.metrics.get("first_token_time", now) - arrival)
            scheduled = out.metrics.get("scheduled_time")
            if scheduled is not None:
                m.queue.observe(max(0.0, scheduled - arrival))
        else:
            m.itl.observe(now - last)
        if out.finished and out.outputs[0].finish_reason in ("stop", "length"):
            m.e2e.observe(now - arrival)
            m.success(out.outputs[0].finish_reason)


class _EngineCollector(Collector):
    """Engine gauges and totals, read from `stats()` at scrape time (nothing while loading)."""

    def __init__(self, stats: Callable[[], ServingStats | None], model_name: Callable[[], str | None]) -> None:
        self._stats = stats
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # metrics are only known once the engine is up; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats, name = self._stats(), self._model_name()
        if stats is None or name is None:
            return
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (1 = full).", stats.kv_cache_usage),
            "num_kv_blocks_free": ("KV cache blocks free.", stats.num_free_kv_blocks),
            "num_kv_blocks_total": ("KV cache blocks in all.", stats.num_kv_blocks),
            "prefix_cache_blocks": ("KV blocks findable in the prefix cache (in use or free).",
                                    stats.num_cached_blocks),
            "prefix_cache_hit_rate": ("Prefix-cache hits / queries, in tokens, since start.",
                                      stats.prefix_cache_hits / stats.prefix_cache_queries
                                      if stats.prefix_cache_queries else 0.0),
        }
        spec = stats.spec_decode
        if spec is not None:
            gauges["spec_decode_acceptance_rate"] = ("Proposal tokens kept / proposed, since start.",
                                                     spec.acceptance_rate)
            gauges["spec_decode_mean_acceptance_length"] = (
                "Tokens a verification yields on average, the model's own included, since start.",
                spec.mean_acceptance_length)
        for key, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(PREFIX + key, doc, labels=["model_name"])
            gauge.add_metric([name], value)
            yield gauge
        counters = {
            "prompt_tokens": ("Prompt tokens admitted.", stats.prompt_tokens_total),
            "generation_tokens": ("Tokens generated.", stats.generation_tokens_total),
            "num_preemptions": ("Requests preempted (blocks taken back, recomputed later).", stats.num_preemptions),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
        }
        if spec is not None:
            counters["spec_decode_num_drafts"] = ("Verifications: request-steps that carried proposal tokens.",
                                                  spec.num_drafts)
            counters["spec_decode_num_draft_tokens"] = ("Proposal tokens verified.", spec.num_draft_tokens)
            counters["spec_decode_num_accepted_tokens"] = ("Proposal tokens kept.", spec.num_accepted_tokens)
        for key, (doc, value) in counters.items():
            counter = CounterMetricFamily(PREFIX + key, doc, labels=["model_name"])  # exposed as <name>_total
            counter.add_metric([name], value)
            yield counter
