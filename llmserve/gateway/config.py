"""The gateway's configuration: a YAML file (`--config`) or, for the simple case, flags; one dataclass tree.

```yaml
models:
  smollm2:                      # the name clients send as "model"
    upstreams: [http://127.0.0.1:8001, http://127.0.0.1:8002]
    balancing: prefix_aware     # round_robin | least_outstanding | prefix_aware
    upstream_model: null        # the name to send upstream (default: the same)
    api_key_env: null           # e.g. OPENAI_API_KEY for a hosted API: read from the environment at start
    health_path: /health        # a hosted API: /v1/models
    price: {input_per_million: 0.15, output_per_million: 0.60}   # an API's list price, or a machine's:
    # price: {dollars_per_hour: 1.20, input_tokens_per_second: 9000, output_tokens_per_second: 700}
    compress: {scorer: smollm2, rate: 0.6, min_tokens: 400}   # prompt compression (compression/): drop the
    # context's least informative words, scored by `scorer` (a small model of `models:`, this one or another),
    # down to rate x the context's tokens; the question, instructions, identifiers, numbers, quotes, URLs and
    # code are kept. Per request: the body's "compress": false | true | {rate: 0.5, ...} (OpenAI's extra_body).
    # Answers say what was done in x-llmserve-compression ("rate=0.58 tokens=812->471" or "skipped: <reason>")
  qwen-pd:                      # prefill/decode disaggregation (`llmserve serve --role prefill|decode`): chat and
    prefill: [http://10.0.0.1:8000]     # completions prefill on a prefill instance, then decode on a decode one
    decode: [http://10.0.0.2:8000, http://10.0.0.3:8000]   # that pulls the prompt's KV from it; both or neither
    upstreams: [http://10.0.0.4:8000]   # optional with both: role `both` instances, the fallback when a hop fails
routers:                        # names that resolve per request to a weak or a strong model (routing/router.py)
  coder: {weak: qwen-0.5b, strong: qwen-1.5b, router: learned, file: coder-router.json, strong_share: 0.3}
keys:                           # none: open, every caller in namespace "default"
  - {key_env: TEAM_A_KEY, namespace: team-a, requests_per_minute: 600, tokens_per_minute: 200000}
  - {key_env: TEAM_B_KEY}       # no namespace: its own (cache, limits, costs); keys share one only when named
admin_key_env: GATEWAY_ADMIN_KEY  # with keys, /dashboard, /metrics and /docs need this key (admin.py)
open_admin: false               # true: those pages open to anyone, on purpose
cache:
  redis_url: redis://127.0.0.1:6379/0   # none: an in-process store
  ttl: 3600
  exact: true
  semantic: false
  semantic_threshold: 0.97
  deterministic_only: true
health: {interval: 2.0, timeout: 2.0, eject_after: 3, eject_seconds: 5.0, down_after: 3}
retries: 2
```
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from llmserve.gateway.compression.policy import CompressPolicy
from llmserve.gateway.pricing import FREE, Price
from llmserve.gateway.routing.router import RouterConfig

BALANCING = ("round_robin", "least_outstanding", "prefix_aware")


@dataclass(frozen=True)
class ModelRoute:
    name: str
    upstreams: tuple[str, ...]
    balancing: str = "least_outstanding"
    upstream_model: str | None = None
    api_key: str | None = None  # resolved from api_key_env at load time, never written in the file
    health_path: str = "/health"  # what the prober GETs; a hosted API has none: "/v1/models"
    price: Price = FREE  # what its tokens cost (usage.cost, the cost metrics); none given: free
    compress: CompressPolicy | None = None  # its prompts' compression; None: only where a request asks for it
    # prefill/decode disaggregation: instances that compute prompts' KV, and instances that pull it and decode;
    # both or neither. With both, `upstreams` (role `both` instances) is the fallback and may be empty
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.prefill) != bool(self.decode):
            given, missing = ("prefill", "decode") if self.prefill else ("decode", "prefill")
            raise ValueError(f"model {self.name!r}: {given} without {missing}: disaggregation needs both prefill and "
                             "decode instances (or neither)")
        if not self.upstreams and not self.prefill:
            raise ValueError(f"model {self.name!r}: no upstreams (or prefill and decode)")
        for role, urls in (("upstream", self.upstreams), ("prefill", self.prefill), ("decode", self.decode)):
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"model {self.name!r}: {role} {url!r} is not an http(s) URL")
        if self.balancing not in BALANCING:
            raise ValueError(f"model {self.name!r}: balancing must be one of {', '.join(BALANCING)}, "
                             f"not {self.balancing!r}")


@dataclass(frozen=True)
class APIKey:
    key: str
    # what the key's callers share (cached answers, limits' counters, cost labels) with the other keys that name
    # it; None: a namespace of its own, so no caller ever gets another key's cached answer by default
    namespace: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if self.namespace is None:  # named by a digest: the key itself never reaches a label or a log
            object.__setattr__(self, "namespace", "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:10])


@dataclass(frozen=True)
class CacheConfig:
    redis_url: str | None = None
    ttl: float = 3600.0
    exact: bool = True
    semantic: bool = False
    # 0.97: on fow-cache's hard negatives, about the least expected cost when a wrong answer costs 5-10
    # upstream calls; a looser threshold, even guarded, serves many of them a wrong answer
    # (docs/performance.md, "The gateway")
    semantic_threshold: float = 0.97
    deterministic_only: bool = True  # cache only temperature-0 or seeded requests

    def __post_init__(self) -> None:
        if self.ttl <= 0:
            raise ValueError("cache.ttl must be > 0 seconds")
        if not 0.0 < self.semantic_threshold <= 1.0:
            raise ValueError("cache.semantic_threshold must be in (0, 1]")


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 2.0  # seconds between active /health probes of each replica
    timeout: float = 2.0
    eject_after: int = 3  # consecutive failures (errors, timeouts) that eject a replica
    down_after: int = 3  # consecutive probes without an answer (timeout, refused) that mark a replica not ready
    eject_seconds: float = 5.0  # first ejection; doubles on each failed half-open trial, up to 60 s


@dataclass(frozen=True)
class GatewayConfig:
    models: dict[str, ModelRoute]
    routers: dict[str, RouterConfig] = field(default_factory=dict)
    keys: tuple[APIKey, ...] = ()
    cache: CacheConfig = field(default_factory=CacheConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    retries: int = 2  # other replicas tried after a failure before the first byte
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # between two bytes of an upstream answer
    max_request_body_bytes: int = 4 * 1024 * 1024
    prefix_balance_slack: int = 4  # prefix_aware: outstanding requests a warm replica may carry above the least
    admin_key: str | None = None  # read from admin_key_env at load time, never written in the file
    open_admin: bool = False  # the admin pages open to anyone even while keys are set, on purpose

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no models: give --upstream NAME=URL[,URL...] or a config file with 'models'")
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        for name, router in self.routers.items():
            if name in self.models:
                raise ValueError(f"routers.{name}: a model has that name already")
            for role in ("weak", "strong", "judge_model"):
                model = getattr(router, role)
                if model is not None and model not in self.models:
                    raise ValueError(f"routers.{name}.{role}: {model!r} is not one of the models")
        for name, route in self.models.items():
            if route.compress is not None and route.compress.scorer not in (None, *self.models):
                raise ValueError(f"models.{name}.compress.scorer: {route.compress.scorer!r} is not one of the models")
            clash = [role_pool(name, role) for role in ("prefill", "decode") if route.prefill]
            if set(clash) & set(self.models):
                raise ValueError(f"models.{name}: its prefill/decode replicas are kept as {' and '.join(clash)}, "
                                 "which another model is named")

    def key_table(self) -> dict[str, APIKey]:
        return {k.key: k for k in self.keys}

    @property
    def admin_protected(self) -> bool:
        """Whether the admin pages need the admin key: once callers need keys, unless opened on purpose."""
        return bool(self.keys or self.admin_key) and not self.open_admin

    def shared_namespaces(self) -> dict[str, int]:
        """Namespaces that several keys name on purpose, and how many keys each."""
        counts: dict[str, int] = {}
        for k in self.keys:
            counts[k.namespace] = counts.get(k.namespace, 0) + 1
        return {name: n for name, n in counts.items() if n > 1}


def role_pool(model: str, role: str) -> str:
    """Where a disaggregated model's `prefill` or `decode` replicas are kept among the pools of replicas (its
    `upstreams` are under its own name): so health probes, metrics and the dashboard cover them too."""
    return f"{model}/{role}"


def load_config(path: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """The file (if any), then the flags' values on top (None: not given)."""
    raw: dict[str, Any] = {}
    if path is not None:
        import yaml

        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    models = {name: _model(name, spec) for name, spec in (raw.get("models") or {}).items()}
    for name, route in (overrides.pop("models", None) or {}).items():
        models[name] = route
    routers = {name: RouterConfig(name=name, **_only(RouterConfig, dict(spec or {}), f"routers.{name}"))
               for name, spec in (raw.get("routers") or {}).items()}
    keys = tuple(_key(entry) for entry in raw.get("keys") or ()) + tuple(overrides.pop("keys", None) or ())
    cache = _section(CacheConfig, raw.get("cache"), "cache", overrides.pop("cache", None))
    health = _section(HealthConfig, raw.get("health"), "health", None)
    top = {k: v for k, v in raw.items() if k not in ("models", "routers", "keys", "cache", "health", "admin_key_env")}
    admin_env = raw.get("admin_key_env")
    if admin_env:
        top["admin_key"] = os.environ.get(admin_env)
        if not top["admin_key"]:
            raise ValueError(f"admin_key_env names {admin_env}, which is not set")
    top.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(GatewayConfig)}
    unknown = set(top) - known
    if unknown:
        raise ValueError(f"unknown gateway setting(s): {', '.join(sorted(unknown))}")
    return GatewayConfig(models=models, routers=routers, keys=keys, cache=cache, health=health, **top)


def parse_upstream(spec: str, balancing: str | None = None) -> ModelRoute:
    """NAME=URL[,URL...] (the --upstream flag)."""
    name, sep, urls = spec.partition("=")
    if not sep or not name or not urls:
        raise ValueError(f"--upstream {spec!r}: expected NAME=URL[,URL...]")
    return ModelRoute(name=name, upstreams=tuple(u.strip().rstrip("/") for u in urls.split(",") if u.strip()),
                      **({"balancing": balancing} if balancing else {}))


def _model(name: str, spec: dict[str, Any]) -> ModelRoute:
    spec = dict(spec or {})
    env = spec.pop("api_key_env", None)
    api_key = os.environ.get(env) if env else None
    if env and not api_key:
        raise ValueError(f"model {name!r}: api_key_env names {env}, which is not set")
    price = spec.pop("price", None)
    if price is not None and not isinstance(price, dict):
        raise ValueError(f"models.{name}.price: a mapping, e.g. {{input_per_million: 0.15, output_per_million: 0.6}}")
    compress = spec.pop("compress", None)
    if compress is not None and not isinstance(compress, dict):
        raise ValueError(f"models.{name}.compress: a mapping, e.g. {{scorer: NAME, rate: 0.6}}")
    policy = CompressPolicy.from_config(compress, f"models.{name}.compress") if compress is not None else None
    upstreams, prefill, decode = (_urls(spec, role) for role in ("upstreams", "prefill", "decode"))
    return ModelRoute(name=name, upstreams=upstreams, prefill=prefill, decode=decode, api_key=api_key,
                      price=Price.from_config(price, f"models.{name}.price") if price is not None else FREE,
                      compress=policy,
                      **_only(ModelRoute, spec, f"models.{name}"))


def _urls(spec: dict[str, Any], name: str) -> tuple[str, ...]:
    """A list of URLs, or one, popped from a model's spec."""
    urls = spec.pop(name, None) or []
    return tuple(u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls))


def _key(entry: dict[str, Any]) -> APIKey:
    entry = dict(entry)
    env = entry.pop("key_env", None)
    key = os.environ.get(env) if env else entry.pop("key", None)
    if not key:
        raise ValueError(f"keys: an entry has no key (key_env {env} is not set)" if env else
                         "keys: every entry needs 'key' or 'key_env'")
    return APIKey(key=key, **_only(APIKey, entry, "keys"))


def _section(cls: type, raw: dict[str, Any] | None, where: str, override: dict[str, Any] | None) -> Any:
    values = dict(raw or {})
    values.update({k: v for k, v in (override or {}).items() if v is not None})
    return cls(**_only(cls, values, where))


def _only(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in fields(cls)} - {"name", "upstreams", "api_key", "key", "price", "compress"}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}")
    return values
