"""The periodic engine log line: what an operator tails to see load, cache health and preemptions."""

from __future__ import annotations

import logging
import time

from llmserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("llmserve.engine")


class StatLogger:
    """Logs throughput since the last line, queue sizes, KV usage, prefix-cache hit rate, preemptions."""

    def __init__(self, engine: LLMEngine, interval_s: float = 10.0) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0

    def maybe_log(self, prompt_tokens_total: int, generation_tokens_total: int) -> str | None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        line = self.line(prompt_tokens_total, generation_tokens_total, elapsed)
        self._last_time, self._last_prompt, self._last_generation = now, prompt_tokens_total, generation_tokens_total
        logger.info(line)
        return line

    def line(self, prompt_tokens_total: int, generation_tokens_total: int, elapsed: float) -> str:
        sched, kv = self.engine.scheduler, self.engine.kv_cache
        prompt_rate = (prompt_tokens_total - self._last_prompt) / elapsed
        gen_rate = (generation_tokens_total - self._last_generation) / elapsed
        return (
            f"prompt {prompt_rate:.1f} tok/s, generation {gen_rate:.1f} tok/s | running {len(sched.running)}, "
            f"waiting {len(sched.waiting)} | KV cache {kv.usage:.1%} used, {kv.pool.num_cached_blocks} cached "
            f"blocks | prefix cache hit rate {kv.stats.hit_rate:.1%} ({kv.stats.hits}/{kv.stats.queries} tokens)"
            f" | preemptions {sched.num_preemptions}"
        )
