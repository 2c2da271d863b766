"""The client against a real streaming server: timings, token counts, error kinds, no hangs."""

from __future__ import annotations

import bisect
import itertools
import time

from .fake_server import FakeOpenAIServer
from .helpers import free_port, run_bench


def _records(result):
    return [r for lv in result.levels for r in lv.records]


def test_paced_stream_timing_and_exact_tokens(fake_server: FakeOpenAIServer) -> None:
    # the server: first token after 100 ms, then one every 20 ms, 16 tokens, usage chunk, [DONE]
    res = run_bench(fake_server.base("paced"), concurrency=(1, 3), num=(3, 6))
    s1, s3 = (lv.summary for lv in res.levels)
    for s in (s1, s3):
        assert s["num_ok"] == s["num_requests"] and s["errors_by_kind"] == {}
        assert abs(s["ttft_p50_ms"] - 100) <= 40, s
        assert abs(s["itl_p50_ms"] - 20) <= 10, s
        assert abs(s["tpot_p50_ms"] - 20) <= 10, s
        assert abs(s["e2e_p50_ms"] - 400) <= 80, s
        assert s["output_tokens_total"] == 16 * s["num_requests"]
    for r in _records(res):
        assert r.output_tokens == 16 and r.output_tokens_source == "usage"
        assert len(r.chunk_times_s) == 16 and r.chunk_tokens == [1] * 16
        assert len(r.itl_s) == 15
        assert r.finish_reason == "length"
        assert r.text.split() == [f"t{i:02d}" for i in range(16)]
    body = fake_server.requests[-1]["body"]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 16 and body["model"] == "fake-model"
    assert body["messages"][0]["role"] == "user"


def test_chunk_with_two_tokens_splits_the_gap(fake_server: FakeOpenAIServer) -> None:
    # chunk 5 carries tokens 5 and 6, sent together 40 ms after chunk 4: recorded as two 20 ms gaps. Events that
    # arrive in one network read are one chunk (a loaded host can merge paced ones too), so the test holds what is
    # true of any split: a chunk of k tokens gives k equal gaps, one sample per token after the first.
    res = run_bench(fake_server.base("grouped"), concurrency=(2,), num=(2,))
    for r in _records(res):
        assert r.ok and r.output_tokens == 16 and r.output_tokens_source == "usage"
        assert len(r.chunk_times_s) == len(r.chunk_tokens) <= 15 and sum(r.chunk_tokens) == 16
        assert len(r.itl_s) == 15
        ends = list(itertools.accumulate(r.chunk_tokens))
        assert r.chunk_tokens[bisect.bisect_right(ends, 5)] >= 2  # tokens 5 and 6 share a chunk
        assert r.itl_s[: r.chunk_tokens[0] - 1] == [0.0] * (r.chunk_tokens[0] - 1)  # a first chunk's own tokens
        sample = r.chunk_tokens[0] - 1
        for c in range(1, len(r.chunk_times_s)):
            gap = r.chunk_times_s[c] - r.chunk_times_s[c - 1]
            for _ in range(r.chunk_tokens[c]):
                assert abs(r.itl_s[sample] - gap / r.chunk_tokens[c]) < 1e-9
                sample += 1
        if len(r.chunk_times_s) == 15:  # as paced (no merged reads): the two-token chunk came 40 ms after the last
            assert r.chunk_tokens[5] == 2 and r.chunk_times_s[5] - r.chunk_times_s[4] >= 0.030


def test_two_token_chunk_without_usage_tokenizer_counts(fake_server: FakeOpenAIServer, counter) -> None:
    res = run_bench(fake_server.base("grouped-nousage"), concurrency=(1,), num=(2,), counter=counter)
    for r in _records(res):
        assert r.output_tokens == 16 and r.output_tokens_source == "tokenizer"
        assert r.chunk_tokens[5] == 2 and len(r.itl_s) == 15
    # without a tokenizer or usage, chunks are all we know: documented undercount
    res = run_bench(fake_server.base("grouped-nousage"), concurrency=(1,), num=(1,))
    (r,) = _records(res)
    assert r.output_tokens == 15 and r.output_tokens_source == "chunks"


def test_failures_are_counted_by_kind_and_the_run_goes_on(fresh_server: FakeOpenAIServer) -> None:
    # concurrency 1 keeps the order: requests 3, 6, 9 -> HTTP 500; request 5 -> an HTML page with 200
    res = run_bench(fresh_server.base("flaky"), concurrency=(1, 2), num=(9, 4))
    s = res.levels[0].summary
    assert s["errors_by_kind"] == {"http_500": 3, "malformed": 1}
    assert s["num_ok"] == 5 and s["num_failed"] == 4
    bad = [r for r in res.levels[0].records if not r.ok]
    assert {r.http_status for r in bad} == {500, 200}
    assert any("internal error" in (r.error or "") for r in bad)
    assert any("<!DOCTYPE html>" in (r.error or "") for r in bad)
    assert res.levels[1].summary["num_requests"] == 4  # the next level still ran
    assert not res.all_failed


def test_non_openai_servers(fake_server: FakeOpenAIServer) -> None:
    res = run_bench(fake_server.base("html"), concurrency=(2,), num=(3,))
    assert res.levels[0].summary["errors_by_kind"] == {"malformed": 3}
    assert res.all_failed
    res = run_bench(fake_server.base("nothing-here"), concurrency=(1,), num=(2,))
    assert res.levels[0].summary["errors_by_kind"] == {"http_404": 2}
    res = run_bench(fake_server.base("cut"), concurrency=(1,), num=(2,))
    assert res.levels[0].summary["errors_by_kind"] == {"disconnect": 2}


def test_unreachable_url_fails_fast() -> None:
    t0 = time.perf_counter()
    res = run_bench(f"http://127.0.0.1:{free_port()}", concurrency=(1, 4), num=(3, 8), warmup=1)
    assert time.perf_counter() - t0 < 10
    assert [lv.summary["errors_by_kind"] for lv in res.levels] == [{"connect": 3}, {"connect": 8}]
    assert res.all_failed
    assert res.warmup[0].error_kind == "connect"


def test_request_timeout_bounds_a_silent_server(fake_server: FakeOpenAIServer) -> None:
    t0 = time.perf_counter()
    res = run_bench(fake_server.base("slow"), concurrency=(2,), num=(2,), request_timeout=0.3)
    assert time.perf_counter() - t0 < 2.5
    assert res.levels[0].summary["errors_by_kind"] == {"timeout": 2}


def test_ignore_eos_is_dropped_when_the_server_rejects_it(fake_server: FakeOpenAIServer) -> None:
    res = run_bench(fake_server.base("strict"), concurrency=(1,), num=(2,), warmup=1)
    assert res.client.ignore_eos is False
    assert any("ignore_eos" in n for n in res.notes)
    assert all(r.ok for r in _records(res))
    assert "ignore_eos" not in fake_server.requests[-1]["body"]
    res = run_bench(fake_server.base("strict"), concurrency=(1,), num=(1,), ignore_eos=False)
    assert all(r.ok for r in _records(res)) and res.notes == []


def test_completions_endpoint_and_api_key(fake_server: FakeOpenAIServer) -> None:
    res = run_bench(fake_server.base("fast"), concurrency=(1,), num=(2,), endpoint="completions", api_key="sekrit")
    assert all(r.ok and r.output_tokens == 8 for r in _records(res))
    req = fake_server.requests[-1]
    assert req["path"].endswith("/v1/completions")
    assert isinstance(req["body"]["prompt"], str) and "messages" not in req["body"]
    assert req["headers"]["Authorization"] == "Bearer sekrit"


def test_open_loop_rate_and_duration(fake_server: FakeOpenAIServer) -> None:
    res = run_bench(fake_server.base("fast"), concurrency=(), num=(8,), rates=[40.0, float("inf")])
    s_rate, s_inf = (lv.summary for lv in res.levels)
    assert s_rate["mode"] == "rate" and s_rate["request_rate"] == 40.0 and s_rate["num_ok"] == 8
    assert s_inf["request_rate"] == "inf" and s_inf["num_ok"] == 8
    starts = [r.start_s for r in res.levels[0].records]
    assert starts == sorted(starts) and starts[-1] > 0.02  # arrivals spread out (Poisson, 40/s)
    assert max(r.start_s for r in res.levels[1].records) < 0.1  # inf: all at once
    res = run_bench(fake_server.base("fast"), concurrency=(2,), num=(), duration=0.3)
    s = res.levels[0].summary
    assert s["num_requests"] >= 4 and s["num_ok"] == s["num_requests"]


def test_goodput_under_slo(fake_server: FakeOpenAIServer) -> None:
    res = run_bench(fake_server.base("paced"), concurrency=(2,), num=(2,), slo="ttft=500ms,tpot=50ms")
    s = res.levels[0].summary
    assert s["goodput_req_per_s"] == s["req_per_s"] and s["slo_attainment"] == 1.0
    assert s["slo"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    res = run_bench(fake_server.base("paced"), concurrency=(2,), num=(2,), slo="ttft=10ms")
    assert res.levels[0].summary["goodput_req_per_s"] == 0.0
