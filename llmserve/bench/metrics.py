"""Per-level aggregation of request records: latency percentiles, throughput, errors, SLO goodput.

Why separate from the client: the same records are summarised live (progress bar), at the end of a
level, and again from a saved JSON; keeping the arithmetic pure (no I/O, no clock) makes it testable.

Conventions: latencies in ms; percentiles by linear interpolation between closest ranks (numpy's
default); only successful requests enter latency/throughput figures; throughput divides by the
level's wall time (first send to last completion). Goodput = requests/s that succeeded AND met every
SLO given (`--slo ttft=200ms,tpot=50ms,e2e=2s`; itl=... means every gap of the request under it).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmserve.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
_SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2e", "e2el": "e2e", "latency": "e2e"}
_DUR_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


@dataclass(frozen=True)
class SLO:
    """Per-request latency objectives in seconds; None = not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def is_empty(self) -> bool:
        return all(v is None for v in (self.ttft, self.tpot, self.itl, self.e2e))

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft, r.ttft_s), (self.tpot, r.tpot_s), (self.e2e, r.latency_s))
        for limit, value in checks:
            if limit is not None and (value is None or value > limit):
                return False
        return self.itl is None or all(g <= self.itl for g in r.itl_s)

    def to_json(self) -> dict[str, float]:
        return {f"{k}_ms": v * 1000.0 for k, v in vars(self).items() if v is not None}


def parse_duration(text: str) -> float:
    """'200ms' -> 0.2, '1.5s' -> 1.5, '200' -> 0.2 (bare numbers are milliseconds)."""
    m = _DUR_RE.match(text)
    if not m:
        raise ValueError(f"bad duration {text!r} (use e.g. 200ms or 1.5s)")
    value = float(m.group(1))
    return value if m.group(2) == "s" else value / 1000.0


def parse_slo(text: str | None) -> SLO:
    """'ttft=200ms,tpot=50ms' -> SLO(ttft=0.2, tpot=0.05)."""
    if not text:
        return SLO()
    values: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in _SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: use ttft=, tpot=, itl= or e2e= with a duration")
        values[_SLO_KEYS[key]] = parse_duration(val)
    return SLO(**values)


def percentile(xs: Sequence[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy 'linear'); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def _dist(prefix: str, xs: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"{prefix}_mean_ms": _ms(statistics.fmean(xs)) if xs else None}
    for p in PERCENTILES:
        out[f"{prefix}_p{p}_ms"] = _ms(percentile(xs, p))
    return out


def summarize(records: Sequence[RequestRecord], wall_s: float, slo: SLO | None = None,
              level: dict[str, Any] | None = None) -> dict[str, Any]:
    """One level's summary. `level` (e.g. {"mode": "concurrency", "concurrency": 8}) is merged in first.

    Keys are a superset of peerbench loadgen's summary, so `compare` reads both kinds of file.
    """
    ok = [r for r in records if r.ok]
    errors = Counter(r.error_kind or "unknown" for r in records if not r.ok)
    out_tok = sum(r.output_tokens for r in ok)
    server_prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    rate = (lambda x: x / wall_s) if wall_s > 0 else (lambda x: None)
    s: dict[str, Any] = dict(level or {})
    s.update({
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "errors_by_kind": dict(sorted(errors.items())),
        "wall_s": round(wall_s, 4),
        "output_tokens_total": out_tok,
        "output_tokens_per_req_mean": (out_tok / len(ok)) if ok else None,
        "output_tokens_per_req_min": min((r.output_tokens for r in ok), default=None),
        "output_tokens_per_req_max": max((r.output_tokens for r in ok), default=None),
        "prompt_tokens_server_mean": statistics.fmean(server_prompt) if server_prompt else None,
        "prompt_tokens_expected_mean": (statistics.fmean(r.prompt_tokens_expected for r in records)
                                        if records else None),
        "output_tok_per_s": rate(out_tok),
        "total_tok_per_s": rate(out_tok + sum(server_prompt or [r.prompt_tokens_expected for r in ok])),
        "req_per_s": rate(len(ok)),
        "chunks_per_req_mean": statistics.fmean(len(r.chunk_times_s) for r in ok) if ok else None,
    })
    s.update(_dist("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]))
    s.update(_dist("itl", [g for r in ok for g in r.itl_s]))
    s.update(_dist("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]))
    s.update(_dist("e2e", [r.latency_s for r in ok if r.latency_s is not None]))
    if slo is not None and not slo.is_empty():
        good = sum(1 for r in records if slo.met_by(r))
        s["slo"] = slo.to_json()
        s["goodput_req_per_s"] = rate(good)
        s["slo_attainment"] = good / len(records) if records else None
    return s
