"""Aggregation arithmetic and token accounting rules (pure functions)."""

from __future__ import annotations

import pytest

from llmserve.bench.client import RequestRecord, allocate_chunk_tokens, api_root, per_token_gaps
from llmserve.bench.metrics import SLO, parse_duration, parse_slo, percentile, summarize
from llmserve.bench.tokens import TokenCounter, approximate_counter


def test_percentile_matches_numpy_linear() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile([], 50) is None and percentile([7.0], 99) == 7.0


def test_parse_slo_and_durations() -> None:
    assert parse_duration("200ms") == pytest.approx(0.2) and parse_duration("1.5s") == 1.5
    assert parse_duration("50") == pytest.approx(0.05)
    slo = parse_slo("ttft=200ms, tpot=50ms,e2e=2s")
    assert slo == SLO(ttft=0.2, tpot=0.05, e2e=2.0)
    assert parse_slo(None).is_empty()
    for bad in ("ttft", "foo=1ms", "ttft=fast"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_allocation_of_tokens_to_chunks(counter: TokenCounter) -> None:
    # usage says 5 tokens over 4 chunks: the extra goes to the chunk with the most characters
    assert allocate_chunk_tokens([" a", " bb cc", " d", " e"], 5, None) == [1, 2, 1, 1]
    assert allocate_chunk_tokens([" a", " b"], None, None) == [1, 1]
    assert allocate_chunk_tokens([" a", " b", " c"], 2, None) == [1, 1, 1]  # never below 1 per chunk
    # with a real tokenizer, chunk contents decide; without one (approximate) every chunk is 1 token
    assert allocate_chunk_tokens([" t01 t02 t03", " t04"], None, counter) == [3, 1]
    assert allocate_chunk_tokens([" t01 t02 t03", " t04"], 3, counter) == [2, 1]  # the server's total wins
    assert allocate_chunk_tokens([" t01 t02 t03", " t04"], None, approximate_counter()) == [1, 1]
    assert per_token_gaps([0.1, 0.12, 0.16], [2, 1, 2]) == pytest.approx([0.0, 0.02, 0.02, 0.02])


def test_api_root() -> None:
    assert api_root("http://h:1") == "http://h:1/v1"
    assert api_root("http://h:1/v1/") == "http://h:1/v1"


def _rec(i: int, ok: bool = True, ttft: float = 0.1, kind: str | None = None) -> RequestRecord:
    r = RequestRecord(stream="s", index=i, prompt_tokens_expected=10)
    if ok:
        r.ok, r.ttft_s, r.latency_s, r.tpot_s = True, ttft, 0.5, 0.02
        r.itl_s, r.chunk_times_s, r.output_tokens, r.prompt_tokens = [0.02] * 3, [0.1] * 4, 4, 12
    else:
        r.error_kind = kind
    return r


def test_summarize_counts_errors_and_goodput() -> None:
    recs = [_rec(0), _rec(1, ttft=0.3), _rec(2, ok=False, kind="http_500"), _rec(3, ok=False, kind="connect")]
    s = summarize(recs, 2.0, SLO(ttft=0.2), {"mode": "concurrency", "concurrency": 4})
    assert s["concurrency"] == 4 and s["num_requests"] == 4 and s["num_ok"] == 2
    assert s["errors_by_kind"] == {"connect": 1, "http_500": 1}
    assert s["output_tok_per_s"] == 4.0 and s["req_per_s"] == 1.0
    assert s["goodput_req_per_s"] == 0.5 and s["slo_attainment"] == 0.25
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["itl_p99_ms"] == pytest.approx(20.0)
    assert s["prompt_tokens_server_mean"] == 12
    empty = summarize([], 0.0)
    assert empty["num_requests"] == 0 and empty["ttft_p50_ms"] is None and "goodput_req_per_s" not in empty
