"""The periodic engine log line: what an operator tails to see load, cache health and preemptions."""

from __future__ import annotations

import logging
import time

from llmserve.engine.llm_engine import EngineStats, LLMEngine
from llmserve.spec_decode.speculator import SpecDecodeStats

logger = logging.getLogger("llmserve.engine")


class StatLogger:
    """Logs throughput since the last line, queue sizes, KV usage, prefix-cache hit rate, preemptions."""

    def __init__(self, engine: LLMEngine, interval_s: float = 10.0) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0
        self._last_spec: SpecDecodeStats | None = None

    def maybe_log(self, prompt_tokens_total: int, generation_tokens_total: int) -> str | None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        line = self.line(self.engine.stats(), prompt_tokens_total, generation_tokens_total, elapsed)
        self._last_time, self._last_prompt, self._last_generation = now, prompt_tokens_total, generation_tokens_total
        logger.info(line)
        return line

    def line(self, stats: EngineStats, prompt_tokens_total: int, generation_tokens_total: int,
             elapsed: float) -> str:
        prompt_rate = (prompt_tokens_total - self._last_prompt) / elapsed
        gen_rate = (generation_tokens_total - self._last_generation) / elapsed
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        return (
            f"prompt {prompt_rate:.1f} tok/s, generation {gen_rate:.1f} tok/s | running {stats.num_running}, "
            f"waiting {stats.num_waiting} | KV cache {stats.kv_cache_usage:.1%} used, {stats.num_cached_blocks} "
            f"cached blocks | prefix cache hit rate {hit_rate:.1%} ({stats.prefix_cache_hits}/"
            f"{stats.prefix_cache_queries} tokens) | preemptions {stats.num_preemptions}" + self._spec_part(stats)
        )

    def _spec_part(self, stats: EngineStats) -> str:
        """Speculative decoding since the last line: proposals kept, and tokens per verification."""
        spec = stats.spec_decode
        if spec is None:
            return ""
        last = self._last_spec or spec.__class__()
        drafts, proposed = spec.num_drafts - last.num_drafts, spec.num_draft_tokens - last.num_draft_tokens
        accepted = spec.num_accepted_tokens - last.num_accepted_tokens
        self._last_spec = spec
        if not drafts:
            return " | speculative: no proposals"
        return (f" | speculative: acceptance {accepted / proposed:.1%} ({accepted}/{proposed}), mean acceptance "
                f"length {1 + accepted / drafts:.2f}")
