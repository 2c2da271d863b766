"""Which replica serves a request: one small class per policy behind `pick(replicas, prefix)`.

`prefix_aware` follows SGLang's cache-aware router in a simpler form: the request's text is cut into
fixed-size chunks, each hashed with everything before it; each replica remembers (bounded, LRU) the chunk
hashes it was sent. A request goes to the replica that holds the longest run of its leading chunks,
i.e. whose prefix cache most likely holds its prompt, unless that replica carries more than `slack`
requests above the least loaded one; then, and for a prefix nobody holds, the least loaded replica wins.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from typing import Any, Protocol

from llmserve.gateway.upstream import Replica

CHUNK_CHARS = 256  # ~64 tokens: a few KV blocks' worth of text
MAX_REMEMBERED = 50_000  # chunk hashes per replica


class Balancer(Protocol):
    def pick(self, replicas: list[Replica], prefix: list[bytes]) -> Replica:
        """One of `replicas` (non-empty, all available); `prefix`: the request's chained chunk hashes."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, replicas: list[Replica], prefix: list[bytes]) -> Replica:
        return replicas[next(self._turn) % len(replicas)]


class LeastOutstanding:
    """Fewest requests in flight; ties go round the ring, so an idle fleet still shares the work."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, replicas: list[Replica], prefix: list[bytes]) -> Replica:
        least = min(r.outstanding for r in replicas)
        tied = [r for r in replicas if r.outstanding == least]
        return tied[next(self._turn) % len(tied)]


class PrefixAware:
    def __init__(self, slack: int = 4) -> None:
        self.slack = slack
        self._seen: dict[str, OrderedDict[bytes, None]] = {}
        self._fallback = LeastOutstanding()

    def pick(self, replicas: list[Replica], prefix: list[bytes]) -> Replica:
        least = min(r.outstanding for r in replicas)
        best, best_len = None, 0
        for replica in replicas:
            if replica.outstanding > least + self.slack:
                continue  # warm but overloaded
            n = self._matched(replica.url, prefix)
            if n > best_len:
                best, best_len = replica, n
        chosen = best or self._fallback.pick(replicas, prefix)
        self._remember(chosen.url, prefix)
        return chosen

    def matched(self, url: str, prefix: list[bytes]) -> int:
        """Leading chunks of `prefix` that `url` was sent before (for tests and metrics)."""
        return self._matched(url, prefix)

    def _matched(self, url: str, prefix: list[bytes]) -> int:
        seen = self._seen.get(url)
        if not seen:
            return 0
        n = 0
        for h in prefix:
            if h not in seen:
                break
            n += 1
        return n

    def _remember(self, url: str, prefix: list[bytes]) -> None:
        seen = self._seen.setdefault(url, OrderedDict())
        for h in prefix:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > MAX_REMEMBERED:
            seen.popitem(last=False)


def make_balancer(policy: str, slack: int = 4) -> Balancer:
    if policy == "round_robin":
        return RoundRobin()
    if policy == "least_outstanding":
        return LeastOutstanding()
    if policy == "prefix_aware":
        return PrefixAware(slack)
    raise ValueError(f"unknown balancing policy {policy!r}")


def prefix_chunks(body: dict[str, Any]) -> list[bytes]:
    """Chained hashes of the request's text in CHUNK_CHARS pieces: the messages' roles and texts in order
    (chat), or the prompt. Only whole chunks count, so a hash always stands for the same text."""
    text = _request_text(body)
    out: list[bytes] = []
    parent = hashlib.sha1(str(body.get("model", "")).encode())
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = parent.copy()
        parent.update(text[start:start + CHUNK_CHARS].encode("utf-8", "surrogatepass"))
        out.append(parent.digest())
    return out


def _request_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role')}>{content or ''}")
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""
