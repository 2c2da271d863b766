"""Prefix caching through the API: cached prompt tokens in `usage`, salts, metrics, periodic log."""

from __future__ import annotations

import openai

from tests.server.conftest import ServerProcess

SYSTEM = " ".join(f"Policy {i}: be brief, be kind, and quote article {i} of the charter." for i in range(14))


def _ask(client: openai.OpenAI, question: str, **extra):
    return client.chat.completions.create(
        model="smollm2-135m", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body={"ignore_eos": True, **extra},
    )


def test_shared_system_prompt_is_reported_as_cached_and_changes_nothing(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    before = server.metrics()
    first = _ask(client, "What is policy 3 about?", cache_salt="prefix-test")
    again = _ask(client, "What is policy 3 about?", cache_salt="prefix-test")
    other = _ask(client, "And policy 7?", cache_salt="prefix-test")
    other_tenant = _ask(client, "What is policy 3 about?", cache_salt="someone-else")
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # a repeat reuses every full block but the one holding the last prompt token
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    assert 160 <= other.usage.prompt_tokens_details.cached_tokens < prompt_tokens
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert other_tenant.choices[0].message.content == first.choices[0].message.content

    after = server.wait_idle()
    hits = after["llmserve:prefix_cache_hits_total"] - before["llmserve:prefix_cache_hits_total"]
    queries = after["llmserve:prefix_cache_queries_total"] - before["llmserve:prefix_cache_queries_total"]
    cached = (again.usage.prompt_tokens_details.cached_tokens + other.usage.prompt_tokens_details.cached_tokens)
    assert hits == cached
    assert queries >= 4 * prompt_tokens - 8
    assert after["llmserve:prefix_cache_blocks"] > 0
    assert 0 < after["llmserve:prefix_cache_hit_rate"] <= 1
    stats_lines = [line for line in server.log().splitlines() if "prefix cache hit rate" in line]
    assert stats_lines and "preemptions" in stats_lines[-1] and "KV cache" in stats_lines[-1]
