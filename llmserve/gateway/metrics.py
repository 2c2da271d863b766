"""The gateway's Prometheus metrics (`llmserve:gateway_*`), in a registry of its own.

What an operator asks of a gateway: how many requests, how many served from cache and of which kind, what
the cache saved (upstream calls, tokens), what the traffic cost and what each lever saved (dollars), how the
replicas behave (latency, health, retries, ejections)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmserve.gateway.upstream import Replica

PREFIX = "llmserve:gateway_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self, replicas: Callable[[], list[Replica]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}requests", "Requests answered, by model and HTTP status.",
                                ["model", "status"], registry=r)
        self.cache_lookups = Counter(f"{PREFIX}cache_lookups", "Cache lookups, by result: exact, semantic, miss.",
                                     ["result"], registry=r)
        self.cache_errors = Counter(f"{PREFIX}cache_errors", "Cache store failures (the cache was bypassed).",
                                    ["operation"], registry=r)
        self.guard_rejections = Counter(f"{PREFIX}cache_guard_rejections",
                                        "Semantic neighbours refused: another number, negation or name.", registry=r)
        self.saved_tokens = Counter(f"{PREFIX}cache_saved_tokens", "Tokens not sent upstream thanks to the cache.",
                                    ["kind"], registry=r)
        self.upstream_latency = Histogram(f"{PREFIX}upstream_latency_seconds",
                                          "Time from sending a request upstream to its last byte.",
                                          ["replica"], buckets=_LATENCY_BUCKETS, registry=r)
        self.upstream_ttfb = Histogram(f"{PREFIX}upstream_first_byte_seconds",
                                       "Time from sending a request upstream to its response headers.",
                                       ["replica"], buckets=_LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter(f"{PREFIX}upstream_errors", "Upstream failures, by replica and kind.",
                                       ["replica", "kind"], registry=r)
        self.retries = Counter(f"{PREFIX}retries", "Requests sent to another replica after a failure.", ["model"],
                               registry=r)
        self.cost = Counter(f"{PREFIX}cost_dollars", "Dollars spent upstream (the model's price), by model and key "
                            "namespace.", ["model", "namespace"], registry=r)
        self.saved = Counter(f"{PREFIX}saved_dollars", "Dollars not spent, by lever: cache_exact, cache_semantic, "
                             "routing, compression.", ["model", "namespace", "lever"], registry=r)
        self.routed = Counter(f"{PREFIX}routed_requests", "Requests to a routed name, by the model it chose.",
                              ["router", "model"], registry=r)
        self.compressions = Counter(f"{PREFIX}compressions", "Requests under a compression policy, by outcome: "
                                    "compressed, or why not (short, code_edit, structured, scorer_error, ...).",
                                    ["model", "outcome"], registry=r)
        self.compression_removed_tokens = Counter(f"{PREFIX}compression_removed_tokens",
                                                  "Context tokens (the scorer's count) that compression kept from "
                                                  "the upstream.", ["model"], registry=r)
        self.rate_limited = Counter(f"{PREFIX}rate_limited", "Requests refused by a key's rate limits.",
                                    ["namespace", "limit"], registry=r)
        self.disaggregated = Counter(f"{PREFIX}disaggregated_requests", "Chat and completion requests of "
                                     "prefill/decode models, by outcome: prefill_decode, fallback_prefill_failed, "
                                     "fallback_decode_failed.", ["model", "outcome"], registry=r)
        self.prefill_seconds = Histogram(f"{PREFIX}prefill_seconds", "Time of a successful prefill hop (its "
                                         "retries included), before a decode instance goes on.", ["model"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        for result in ("exact", "semantic", "miss"):
            self.cache_lookups.labels(result)
        r.register(_ReplicaCollector(replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaCollector(Collector):
    """Replica state read when scraped, so it never drifts from what the balancer sees."""

    def __init__(self, replicas: Callable[[], list[Replica]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(f"{PREFIX}replica_healthy", "1 while a replica takes traffic.",
                                    labels=["model", "replica"])
        outstanding = GaugeMetricFamily(f"{PREFIX}replica_outstanding_requests", "Requests in flight to a replica.",
                                        labels=["model", "replica"])
        ejections = GaugeMetricFamily(f"{PREFIX}replica_ejections", "Times a replica was ejected (passive health).",
                                      labels=["model", "replica"])
        now = time.monotonic()
        for replica in self._replicas():
            labels = [replica.model, replica.url]
            healthy.add_metric(labels, float(replica.available(now)))
            outstanding.add_metric(labels, float(replica.outstanding))
            ejections.add_metric(labels, float(replica.ejections))
        yield from (healthy, outstanding, ejections)
