"""Per-request sampling parameters, with vLLM's names and OpenAI's semantics."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

# Below this a temperature is greedy (as vLLM): dividing logits by it would overflow to inf and NaN.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a constrained request's output must match: exactly one of these (vLLM's names).

    json: a JSON schema (dict or its text); json_object: any JSON object (OpenAI's JSON mode); regex; choice:
    one of these strings exactly; grammar: a Lark grammar in llguidance's dialect (which can embed JSON
    schemas with `%json {...}`)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured outputs: a JSON schema must be an object")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints, so compiled grammars can be shared."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return "json", json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.regex is not None:
            return "regex", self.regex
        return "grammar", self.grammar or ""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise `ValueError` naming the field.

    temperature 0 (or below 1e-5) means greedy. `seed` gives a request its own random stream: its draws
    do not depend on the other requests of a batch (when its text does too: README, "Reproducibility").
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen)
    # per prompt token, its logprob given the tokens before it (and this many top ones): what perplexity
    # and OpenAI's `echo` with `logprobs` need. Such a request's prompt is computed, never read from the
    # prefix cache (a cached block has no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # the output must match a JSON schema, regex, choice or grammar (constrained decoding)
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a number added to its logit before anything else picks (OpenAI's logit_bias: -100 bans a token,
    # +100 all but forces it); reported logprobs stay the model's own
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        self._validate()

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: one sequence, seeded with seed + index (wrapping past
        the largest seed), so the n choices differ and each is reproducible."""
        seed = self.seed
        if seed is not None and index:
            seed = seed + index if seed + index <= SEED_RANGE[1] else seed + index - 2**64
        return replace(self, n=1, seed=seed)

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias must map token ids (>= 0) to biases, got the key {token!r}")
            if not (isinstance(bias, int | float) and math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {bias!r} for {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
