"""The gateway's dashboard (`/dashboard`): a page that polls `/dashboard/data`, a JSON snapshot of the metrics.

The snapshot is read from the same Prometheus registry `/metrics` renders, so the page can never disagree with
what an operator's Prometheus scrapes; the page turns the counters into rates itself (deltas between polls).
One static file with its script inline: no CDN, no build step, nothing to fetch on a machine without network.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

PAGE = Path(__file__).with_name("dashboard.html")
# what the page shows, by metric family name (without llmserve:gateway_ and _total)
FAMILIES = ("requests", "cache_lookups", "cache_saved_tokens", "routed_requests", "cost_dollars", "saved_dollars",
            "retries", "upstream_errors", "rate_limited", "replica_healthy", "replica_outstanding_requests",
            "replica_ejections")
PREFIX = "llmserve:gateway_"


def page() -> str:
    return PAGE.read_text()


def snapshot(registry: CollectorRegistry) -> dict[str, Any]:
    """{"time": unix seconds, "metrics": {family: [{"labels": {...}, "value": v}, ...]}} for FAMILIES."""
    wanted = set(FAMILIES)
    metrics: dict[str, list[dict[str, Any]]] = {name: [] for name in FAMILIES}
    for family in registry.collect():
        name = family.name.removeprefix(PREFIX)
        if name not in wanted:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            metrics[name].append({"labels": dict(sample.labels), "value": sample.value})
    return {"time": time.time(), "metrics": metrics}
