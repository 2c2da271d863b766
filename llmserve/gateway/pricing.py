"""What a model's tokens cost, so every response can say what it cost and `/metrics` can add it up.

Two sources of a price, one shape: an API's list price ($ per 1M input and output tokens), or a self-hosted
machine's $/hour turned into $ per token by the throughput measured on it (`llmserve bench`, or `llmserve
plan`'s table): a machine that prefills `input_tokens_per_second` or decodes `output_tokens_per_second` at
the load it runs spends one second of its hourly price per that many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MILLION = 1_000_000


@dataclass(frozen=True)
class Price:
    input_per_million: float = 0.0  # $ per 1M prompt tokens
    output_per_million: float = 0.0  # $ per 1M completion tokens

    def __post_init__(self) -> None:
        if self.input_per_million < 0 or self.output_per_million < 0:
            raise ValueError("prices must be >= 0")

    @classmethod
    def self_hosted(cls, dollars_per_hour: float, input_tokens_per_second: float,
                    output_tokens_per_second: float) -> Price:
        if dollars_per_hour < 0:
            raise ValueError("dollars_per_hour must be >= 0")
        if input_tokens_per_second <= 0 or output_tokens_per_second <= 0:
            raise ValueError("a self-hosted price needs measured input and output tokens per second > 0")
        per_second = dollars_per_hour / 3600.0
        return cls(input_per_million=per_second / input_tokens_per_second * MILLION,
                   output_per_million=per_second / output_tokens_per_second * MILLION)

    @classmethod
    def from_config(cls, raw: dict[str, Any], where: str) -> Price:
        """`{input_per_million, output_per_million}` or `{dollars_per_hour, input_tokens_per_second,
        output_tokens_per_second}`."""
        raw = dict(raw)
        hosted = {"dollars_per_hour", "input_tokens_per_second", "output_tokens_per_second"}
        listed = {"input_per_million", "output_per_million"}
        unknown = set(raw) - hosted - listed
        if unknown:
            raise ValueError(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}")
        try:
            if set(raw) & hosted:
                if set(raw) & listed or set(raw) != hosted:
                    raise ValueError(f"{where}: a self-hosted price needs exactly {', '.join(sorted(hosted))}")
                return cls.self_hosted(**{k: float(v) for k, v in raw.items()})
            return cls(**{k: float(v) for k, v in raw.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def cost(self, usage: dict[str, Any] | None) -> float:
        """Dollars for one answer's usage (`prompt_tokens` / `completion_tokens`, or the Responses API's
        `input_tokens` / `output_tokens`)."""
        usage = usage or {}
        prompt = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
        completion = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        return (prompt * self.input_per_million + completion * self.output_per_million) / MILLION


FREE = Price()
