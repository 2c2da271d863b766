"""What a cached answer is keyed by.

The exact key is a digest of everything that can change the answer: the caller's namespace, the route, the
model, the messages or prompt, and every parameter but the two that only change how it is delivered
(`stream`, `stream_options`). Unknown fields stay in the key: a parameter we have not heard of may well
change the output. OpenAI's `user` (the application's end user) stays in it too: one end user's answer, and
what its question said, is never replayed to another, exactly or by meaning.

The semantic scope is the same digest without the last user message: a semantic hit must agree exactly on
the model, the system prompt, every earlier turn and every parameter, and only the last user message is
compared by meaning. So an answer is never replayed into another conversation or namespace.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

# delivery-only fields: the same answer whatever their value
_DELIVERY_FIELDS = frozenset({"stream", "stream_options"})


@dataclass(frozen=True)
class CacheKeys:
    exact: str
    scope: str  # exact minus the compared text
    query: str | None  # the text compared by meaning: the last user message (chat) or the prompt; None: not comparable


def is_deterministic(body: dict[str, Any]) -> bool:
    """Greedy (temperature 0) or seeded: the only requests whose answer is worth replaying by default."""
    temperature = body.get("temperature", 1.0)
    return temperature == 0 or body.get("seed") is not None


def cache_keys(namespace: str, route: str, body: dict[str, Any]) -> CacheKeys:
    shaping = {k: v for k, v in body.items() if k not in _DELIVERY_FIELDS}
    exact = _digest([namespace, route, shaping])
    query: str | None = None
    if route == "chat":
        messages = shaping.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) \
                and messages[-1].get("role") == "user":
            query = _text(messages[-1].get("content"))
            shaping = {**shaping, "messages": messages[:-1]}
    elif isinstance(shaping.get("prompt"), str):
        query = shaping["prompt"]
        shaping = {k: v for k, v in shaping.items() if k != "prompt"}
    scope = _digest([namespace, route, shaping, "scope"]) if query is not None else exact
    return CacheKeys(exact=exact, scope=scope, query=query or None)


def _text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)
    return None  # images or other parts: compared exactly only


def _digest(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()
