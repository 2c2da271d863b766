"""The server's own settings, beside the engine's: a module of its own so the CLI can read their defaults
without importing the engine (and torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.config import EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_names: list[str] | None = None  # None: the engine's model name
    max_queued_requests: int | None = None
    api_key: str | None = field(default=None, repr=False)  # repr=False: a logged config never shows it
    max_request_body_bytes: int = 1 << 20
    request_timeout: float = 30.0  # seconds a client has for a request's headers, and again for its body
    max_connections: int = 1024  # open connections; past them, requests get 503
    max_tokens_default: int | None = 4096  # output cap of a request that sets no max_tokens; None: none
    allowed_origins: list[str] | None = None  # CORS: browser origins allowed to call the API; None: off
    shutdown_timeout: float = 30.0  # seconds running requests may take to finish after a stop signal
    url: str | None = None  # where clients reach us, for the start-up log line
    log_stats_interval: float = 10.0  # seconds between the engine's periodic stats lines
    # disaggregated prefill/decode (server/kv_transfer.py): "prefill" answers KV pulls, "decode" makes them, "both"
    role: str = "both"

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"max_tokens_default must be >= 1 or None, got {self.max_tokens_default}")
        for name in ("max_request_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.role != "both" and not self.engine.cache.enable_prefix_caching:
            raise ValueError(f"role {self.role}: the prompt's KV moves through the prefix cache; leave prefix "
                             "caching on")
        if self.role != "both" and self.engine.parallel.world_size > 1:
            raise ValueError(f"role {self.role}: KV blocks move to or from one process's cache, not parallel ranks")
