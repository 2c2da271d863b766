"""The load to plan for: a request rate, prompt and output length distributions, cache hits.

Why a drawn list of requests rather than means: queueing delay depends on the spread of service times
(Pollaczek-Khinchine), so the simulator is fed lengths drawn from the distribution, not its mean. The
arrivals are drawn at rate 1 and scaled, so runs at different rates with one seed share their random
numbers: a capacity search over the rate then sees a smooth, monotone response.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400.0
DISTRIBUTIONS = ("fixed", "uniform", "exponential")


@dataclass(frozen=True)
class LengthDist:
    """Token counts: fixed at `mean`, uniform in mean*[1-spread, 1+spread], or exponential with that mean
    (geometric-like chat answers); always at least 1."""

    mean: float
    kind: str = "fixed"
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length mean must be >= 1, got {self.mean}")
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"length distribution must be one of {DISTRIBUTIONS}, got {self.kind!r}")
        if not 0 <= self.spread < 1:
            raise ValueError(f"length spread must be in [0, 1), got {self.spread}")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform" and self.spread:
            return max(1, round(rng.uniform(self.mean * (1 - self.spread), self.mean * (1 + self.spread))))
        if self.kind == "exponential":
            return max(1, round(rng.expovariate(1.0 / self.mean)))
        return max(1, round(self.mean))

    def upper(self) -> int:
        """A length that bounds (nearly) every draw: what one sequence's KV must hold."""
        if self.kind == "uniform":
            return round(self.mean * (1 + self.spread))
        if self.kind == "exponential":
            return round(self.mean * 4.6)  # the 99th percentile
        return round(self.mean)


@dataclass(frozen=True)
class Traffic:
    """Requests per second over all clients; `cache_hit_share` of them are answered by a cache in front
    (the gateway's) and never reach a replica."""

    rate: float
    prompt: LengthDist
    output: LengthDist
    cache_hit_share: float = 0.0

    def __post_init__(self) -> None:
        if self.rate < 0:
            raise ValueError(f"request rate must be >= 0, got {self.rate}")
        if not 0 <= self.cache_hit_share < 1:
            raise ValueError(f"cache_hit_share must be in [0, 1), got {self.cache_hit_share}")

    @property
    def miss_rate(self) -> float:
        """Requests/s that need a model."""
        return self.rate * (1.0 - self.cache_hit_share)

    @property
    def tokens_per_request(self) -> float:
        return self.prompt.mean + self.output.mean


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds
    prompt_len: int
    output_len: int


def draw_requests(prompt: LengthDist, output: LengthDist, rate: float, n: int, seed: int = 0,
                  poisson: bool = True) -> list[SimRequest]:
    """n requests arriving at `rate` per second, the first at 0 (as `llmserve bench --request-rate` sends
    them): Poisson (exponential gaps) or evenly spaced."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    lengths = random.Random(seed + 1)  # apart from the gaps: the same lengths at every rate
    t, out = 0.0, []
    for _ in range(n):
        out.append(SimRequest(t / rate, prompt.draw(lengths), output.draw(lengths)))
        t += rng.expovariate(1.0) if poisson else 1.0
    return out
