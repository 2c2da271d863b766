"""The gateway with real replicas, a real redis-server and the official `openai` client."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import socket
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, GatewayProcess, RedisProcess, free_port, gateway_config
from tests.server.conftest import ServerProcess
from tests.structured_output.test_constrained_decoding import FAILS_LATER

QUESTION = [{"role": "user", "content": "Name three colors."}]


def client(gateway: GatewayProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=key, max_retries=0, timeout=120)


def ask(c: openai.OpenAI, messages=QUESTION, stream: bool = False, **kw):
    """(text, x-llmserve-cache header) of a greedy chat completion."""
    args = dict(model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 16), temperature=0, **kw)
    if stream:
        raw = c.chat.completions.with_raw_response.create(stream=True, **args)
        text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    else:
        raw = c.chat.completions.with_raw_response.create(**args)
        text = raw.parse().choices[0].message.content
    return text, raw.headers.get("x-llmserve-cache")


def urls(replicas: list[ServerProcess]) -> list[str]:
    return [r.base for r in replicas]


@pytest.fixture
def gateway(tmp_path, replicas) -> GatewayProcess:
    proc = GatewayProcess(tmp_path, gateway_config(urls(replicas)))
    yield proc
    proc.stop()


def test_cached_answer_equals_live_streamed_or_not(gateway, replicas):
    c = client(gateway)
    direct = openai.OpenAI(base_url=f"{replicas[0].base}/v1", api_key="none", max_retries=0)
    reference, _ = ask(direct, max_tokens=20)
    live, live_kind = ask(c, max_tokens=20)
    assert (live, live_kind) == (reference, "miss")
    assert ask(c, max_tokens=20) == (reference, "hit")
    assert ask(c, stream=True, max_tokens=20) == (reference, "hit")
    # a cached answer replays with usage when asked, as a live stream would end
    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # the same question streamed first: the assembled stream is cached and equals the live answer
    other = [{"role": "user", "content": "Name three animals."}]
    streamed, kind = ask(c, messages=other, stream=True)
    assert kind == "miss"
    assert ask(c, messages=other) == (streamed, "hit")
    # Cache-Control: no-cache skips the lookup (and stores the fresh answer)
    assert ask(c, max_tokens=20, extra_headers={"Cache-Control": "no-cache"}) == (reference, "miss")
    m = gateway.metrics()
    assert m['llmserve:gateway_cache_lookups_total{result=exact}'] == 4
    assert m["llmserve:gateway_cache_saved_tokens_total{kind=completion}"] > 0
    # every replay is a response of its own: its own id, whole or streamed
    ids = [c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0).id
           for _ in range(2)]
    ids += [next(iter(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0,
                                                stream=True))).id]
    assert len(set(ids)) == 3 and all(i.startswith("chatcmpl-") for i in ids)


def test_a_constraint_that_failed_is_passed_on_and_never_cached(gateway):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0, "guided_regex": FAILS_LATER}
    for _ in range(2):
        whole = httpx.post(f"{gateway.base}/v1/chat/completions", json=body, timeout=60)
        assert whole.status_code == 400 and whole.json()["error"]["code"] == "constraint_failed", whole.text
        with httpx.stream("POST", f"{gateway.base}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            assert r.headers["x-llmserve-cache"] == "miss"
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"constraint_failed"' in events[-2]


def test_models_carry_what_the_replicas_say_of_them(gateway):
    [card] = [m for m in client(gateway).models.list().data if m.id == MODEL]
    assert (card.model_extra["root"], card.model_extra["max_model_len"]) == ("smollm2-135m", 2048)


def test_sampled_requests_bypass_the_cache(gateway):
    c = client(gateway)
    for _ in range(2):
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                                          temperature=0.8)
        assert raw.headers.get("x-llmserve-cache") == "miss"
    assert gateway.total("llmserve:gateway_cache_lookups_total") == 0


def test_errors_in_openai_envelope(gateway):
    c = client(gateway)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):  # the replica's own 400, passed through, not retried
        c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=-1)
    r = httpx.post(f"{gateway.base}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert gateway.total("llmserve:gateway_retries_total") == 0


def test_killed_replica_costs_no_request_that_had_not_begun(tmp_path, replicas):
    spare = ServerProcess(tmp_path / "spare.log")
    spare.wait_ready()
    gw = GatewayProcess(tmp_path, gateway_config([replicas[0].base, spare.base], balancing="round_robin",
                                                 health={"interval": 30.0, "eject_seconds": 60.0}))
    try:
        c = client(gw)
        spare.proc.kill()  # no warning: the prober will not look again for 30 s
        spare.proc.wait()
        texts = [ask(c, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=6,
                     extra_headers={"Cache-Control": "no-store"}, stream=bool(i % 2))[0] for i in range(6)]
        assert all(texts)
        m = gw.metrics()
        assert gw.total("llmserve:gateway_retries_total") >= 1
        assert m[f"llmserve:gateway_replica_healthy{{model={MODEL},replica={spare.base}}}"] == 0
        assert m[f"llmserve:gateway_replica_ejections{{model={MODEL},replica={spare.base}}}"] == 1
        assert gw.total("llmserve:gateway_upstream_errors_total") >= 3  # ejected after 3 connection failures
    finally:
        gw.stop()
        spare.stop()


def test_client_disconnect_aborts_the_upstream_request(gateway, replicas):
    with httpx.stream("POST", f"{gateway.base}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 1000,
            "temperature": 0.7, "stream": True, "ignore_eos": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 5:
                break
    for replica in replicas:  # the request stopped within a few steps, its blocks all returned
        m = replica.wait_idle()
        assert m["llmserve:num_requests_running"] == 0
        assert m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"]
    generated = sum(r.metrics().get("llmserve:generation_tokens_total", 0.0) for r in replicas)
    assert generated < 1000


def test_prefix_aware_sends_a_shared_prefix_to_one_replica(tmp_path, replicas):
    gw = GatewayProcess(tmp_path, gateway_config(urls(replicas), balancing="prefix_aware"))
    try:
        c = client(gw)
        before = [r.metrics().get("llmserve:prefix_cache_hits_total", 0.0) for r in replicas]
        system = "You are a careful assistant for the Acme Corporation. " * 12  # ~650 characters
        for i in range(6):
            ask(c, messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}],
                max_tokens=2, extra_headers={"Cache-Control": "no-store"})
        after = [r.metrics().get("llmserve:prefix_cache_hits_total", 0.0) for r in replicas]
        gained = [a - b for a, b in zip(after, before, strict=True)]
        assert sorted(gained)[0] == 0 and sorted(gained)[1] > 0, gained  # one replica served them all, warm
    finally:
        gw.stop()


def test_two_gateways_share_a_redis_cache_and_a_restart_keeps_it(tmp_path, replicas, redis_server: RedisProcess):
    config = gateway_config(urls(replicas), cache={"redis_url": redis_server.url})
    first, second = GatewayProcess(tmp_path, config), GatewayProcess(tmp_path, config)
    try:
        live, kind = ask(client(first))
        assert kind == "miss"
        assert ask(client(second)) == (live, "hit")
        first.stop()
        restarted = GatewayProcess(tmp_path, config)
        try:
            assert ask(client(restarted), stream=True) == (live, "hit")
        finally:
            restarted.stop()
    finally:
        first.stop()
        second.stop()


def test_redis_gone_still_serves(tmp_path, replicas, redis_server: RedisProcess):
    gw = GatewayProcess(tmp_path, gateway_config(urls(replicas), cache={"redis_url": redis_server.url}))
    try:
        live, _ = ask(client(gw))
        redis_server.stop()
        for stream in (False, True):
            assert ask(client(gw), stream=stream) == (live, "miss")
        assert gw.total("llmserve:gateway_cache_errors_total") >= 1
    finally:
        gw.stop()


def test_namespaces_never_leak_and_keys_are_enforced(tmp_path, replicas):
    keys = [{"key": "key-a", "namespace": "team-a"}, {"key": "key-b", "namespace": "team-b"},
            {"key": "key-slow", "namespace": "team-a", "requests_per_minute": 2}]
    gw = GatewayProcess(tmp_path, gateway_config(urls(replicas), keys=keys))
    try:
        with pytest.raises(openai.AuthenticationError):
            ask(client(gw, "wrong"))
        text, kind = ask(client(gw, "key-a"))
        assert kind == "miss"
        assert ask(client(gw, "key-a")) == (text, "hit")
        assert ask(client(gw, "key-b")) == (text, "miss")  # same question, another namespace: no hit
        assert ask(client(gw, "key-slow")) == (text, "hit")  # a key of team-a shares team-a's cache
        ask(client(gw, "key-slow"))
        with pytest.raises(openai.RateLimitError) as e:
            ask(client(gw, "key-slow"))
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert ask(client(gw, "key-a"))[1] == "hit"  # other keys are not limited by it
    finally:
        gw.stop()


def test_concurrent_streams_pass_through_whole(gateway):
    """Many concurrent streams at once: each one's text equals its non-streamed answer."""
    c = client(gateway)
    prompts = [[{"role": "user", "content": f"Tell me a fact about the number {i}."}] for i in range(8)]
    headers = {"Cache-Control": "no-store"}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(lambda m: ask(c, messages=m, stream=True, extra_headers=headers)[0], prompts))
    plain = [ask(c, messages=m, extra_headers=headers)[0] for m in prompts]
    assert streamed == plain



def test_semantic_hits_stay_in_scope_and_the_guard_refuses_another_name(tmp_path, replicas):
    gw = GatewayProcess(tmp_path, gateway_config(urls(replicas), cache={"semantic": True, "semantic_threshold": 0.92}))
    try:
        c = client(gw)
        france = [{"role": "user", "content": "What is the capital of France?"}]
        live, kind = ask(c, messages=france)
        assert kind == "miss"
        reworded = [{"role": "user", "content": "Which city is the capital of France?"}]  # cosine 0.94
        assert ask(c, messages=reworded) == (live, "semantic")
        assert ask(c, messages=reworded, stream=True) == (live, "semantic")
        # the same words after another system prompt, or with other parameters: another scope, no hit
        assert ask(c, messages=[{"role": "system", "content": "Answer in French."}, *reworded])[1] == "miss"
        assert ask(c, messages=reworded, max_tokens=17)[1] == "miss"
        # close in meaning (cosine 0.95) but another day: the guard sends it upstream
        saturday = [{"role": "user", "content": "Is the museum open on Saturday?"}]
        ask(c, messages=saturday)
        assert ask(c, messages=[{"role": "user", "content": "Is the museum open on Sunday?"}])[1] == "miss"
        m = gw.metrics()
        assert m["llmserve:gateway_cache_lookups_total{result=semantic}"] == 2
        assert m["llmserve:gateway_cache_guard_rejections_total"] == 1
    finally:
        gw.stop()


def test_every_answer_reports_its_cost_and_the_metrics_add_it_up(tmp_path, replicas):
    price = {"input_per_million": 150.0, "output_per_million": 600.0}  # large, so the sums are far from rounding
    config = gateway_config(urls(replicas))
    config["models"][MODEL]["price"] = price
    config["keys"] = [{"key": "team-key", "namespace": "team"}]
    config["admin_key"] = "admin-key"
    gw = GatewayProcess(tmp_path, config)

    def expected(usage) -> float:
        return (usage.prompt_tokens * price["input_per_million"]
                + usage.completion_tokens * price["output_per_million"]) / 1e6

    try:
        c = client(gw, "team-key")
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                                          temperature=0)
        answer = raw.parse()
        cost = expected(answer.usage)
        assert answer.usage.model_extra["cost"] == pytest.approx(cost)
        assert float(raw.headers["x-llmserve-cost-usd"]) == pytest.approx(cost)
        # streamed: the usage chunk carries the cost
        chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                                max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        streamed_cost = expected(chunks[-1].usage)
        assert chunks[-1].usage.model_extra["cost"] == pytest.approx(streamed_cost)
        # a cache hit costs nothing and counts what it saved
        hit = c.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                                          temperature=0)
        assert hit.headers["x-llmserve-cache"] == "hit"
        assert hit.parse().usage.model_extra["cost"] == 0.0
        assert float(hit.headers["x-llmserve-saved-usd"]) == pytest.approx(cost)
        m = gw.metrics()
        assert m[f"llmserve:gateway_cost_dollars_total{{model={MODEL},namespace=team}}"] == pytest.approx(
            cost + streamed_cost)
        assert m[f"llmserve:gateway_saved_dollars_total{{lever=cache_exact,model={MODEL},namespace=team}}"] == \
            pytest.approx(cost)
    finally:
        gw.stop()


def test_embeddings_pass_through_and_are_cached(tmp_path, embedding_server):
    name = "all-minilm-l6-v2"
    proc = GatewayProcess(tmp_path, {"models": {name: {"upstreams": [embedding_server.base]}},
                                     "health": {"interval": 0.5, "timeout": 2.0}})
    try:
        c = client(proc)
        direct = openai.OpenAI(base_url=f"{embedding_server.base}/v1", api_key="none", max_retries=0)
        texts = ["The cat sat on the mat.", "Quarterly revenue rose."]
        reference = [d.embedding for d in direct.embeddings.create(model=name, input=texts).data]
        kinds = []
        for _ in range(2):
            raw = c.embeddings.with_raw_response.create(model=name, input=texts)
            assert [d.embedding for d in raw.parse().data] == reference
            kinds.append(raw.headers["x-llmserve-cache"])
        assert kinds == ["miss", "hit"]
        assert proc.total("llmserve:gateway_cache_lookups_total") == 2
    finally:
        proc.stop()


def test_responses_continue_on_the_replica_that_stored_them_for_their_own_key(tmp_path, replicas):
    """Round robin over two replicas: each continuation still reaches the replica holding the response it
    continues (else half would be 404), streamed or not; another key can neither continue nor read it."""
    price = {"input_per_million": 150.0, "output_per_million": 600.0}
    config = gateway_config(urls(replicas), balancing="round_robin",
                            keys=[{"key": "key-a", "namespace": "team-a"}, {"key": "key-b", "namespace": "team-b"}],
                            admin_key="admin-key")
    config["models"][MODEL]["price"] = price
    gw = GatewayProcess(tmp_path, config)
    try:
        a, b = client(gw, "key-a"), client(gw, "key-b")
        first = a.responses.create(model=MODEL, input="Name a color.", max_output_tokens=8, temperature=0)
        assert first.status in ("completed", "incomplete") and first.output_text
        previous = first.id
        for i in range(4):
            if i % 2:
                events = list(a.responses.create(model=MODEL, input="And another?", previous_response_id=previous,
                                                 max_output_tokens=6, temperature=0, stream=True))
                turn = events[-1].response  # response.completed, or .incomplete at the token limit
                assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == turn.output_text
            else:
                turn = a.responses.create(model=MODEL, input="And another?", previous_response_id=previous,
                                          max_output_tokens=6, temperature=0)
            assert turn.previous_response_id == previous and turn.usage.output_tokens > 0
            previous = turn.id
        assert a.responses.retrieve(previous).id == previous
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=MODEL, input="And another?", previous_response_id=previous, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(previous)
        # priced on the Responses API's own usage names; nothing of it is cached
        usage = first.usage
        cost = (usage.input_tokens * price["input_per_million"]
                + usage.output_tokens * price["output_per_million"]) / 1e6
        assert gw.total("llmserve:gateway_cost_dollars_total") > cost
        assert gw.total("llmserve:gateway_cache_lookups_total") == 0
    finally:
        gw.stop()


PIN = "My bank PIN is 4417 and my name is Carol Diaz. "
SECRETS = {  # each key's own question and its rewording (cosine above 0.92)
    "kc": (PIN + "What is the capital of France?", PIN + "Which city is the capital of France?"),
    "kd": ("My card ends in 9921 and I am Dan Reyes. How do I reset my online banking password?",
           "My card ends in 9921 and I am Dan Reyes. How can I reset my online banking password?"),
}


def test_keys_never_get_each_others_cached_answers_unless_they_share_on_purpose(tmp_path, replicas):
    """Two keys from flags, with the semantic cache on: each key's answer, exact or reworded, stays its own, both
    ways; within one key, two end users (`user`) stay apart too; keys that name one namespace share it."""
    config = gateway_config(urls(replicas), cache={"semantic": True, "semantic_threshold": 0.92},
                            keys=[{"key": "k1", "namespace": "team"}, {"key": "k2", "namespace": "team"}])
    gw = GatewayProcess(tmp_path, config, "--api-key", "kc", "--api-key", "kd", "--api-key", "ke")
    question = [{"role": "user", "content": SECRETS["kc"][0]}]
    reworded = [{"role": "user", "content": SECRETS["kc"][1]}]
    try:
        # a probe's own miss is cached in its own namespace: the reworded probe comes from a third key, so that
        # it cannot meet the exact probe's answer
        for owner, other in (("kc", "kd"), ("kd", "kc")):
            mine, mine_reworded = ([{"role": "user", "content": text}] for text in SECRETS[owner])
            text, kind = ask(client(gw, owner), messages=mine)
            assert kind == "miss"
            assert ask(client(gw, owner), messages=mine) == (text, "hit")
            assert ask(client(gw, owner), messages=mine_reworded) == (text, "semantic")  # the cache works
            assert ask(client(gw, other), messages=mine)[1] == "miss"
            assert ask(client(gw, "ke"), messages=mine_reworded)[1] == "miss"
        # one key, two end users
        text, _ = ask(client(gw, "kc"), messages=question, user="carol")
        assert ask(client(gw, "kc"), messages=question, user="carol") == (text, "hit")
        assert ask(client(gw, "kc"), messages=question, user="dan")[1] == "miss"
        assert ask(client(gw, "kc"), messages=reworded, user="erin")[1] == "miss"
        # a namespace named by two keys is shared, and the log says so at start-up
        text, _ = ask(client(gw, "k1"), messages=question)
        assert ask(client(gw, "k2"), messages=question) == (text, "hit")
        assert "namespace 'team' is shared on purpose by 2 keys" in gw.log()
    finally:
        gw.stop()


ADMIN_PATHS = ("/dashboard", "/dashboard/data", "/metrics", "/docs", "/openapi.json")


def test_admin_pages_need_the_admin_key_once_keys_are_set(tmp_path, replicas, gateway):
    for path in ADMIN_PATHS:  # no keys: a local gateway, open
        assert httpx.get(gateway.base + path, timeout=10).status_code == 200, path
    config = gateway_config(urls(replicas), keys=[{"key": "tenant"}], admin_key="admin-secret")
    gw = GatewayProcess(tmp_path / "admin", config)
    closed = GatewayProcess(tmp_path / "closed", gateway_config(urls(replicas), keys=[{"key": "tenant"}]))
    try:
        basic = "Basic " + base64.b64encode(b"anyone:admin-secret").decode()
        for path in ADMIN_PATHS:
            none = httpx.get(gw.base + path, timeout=10)
            assert none.status_code == 401 and "Basic" in none.headers["www-authenticate"], path
            assert none.json()["error"]["message"] == "the admin pages need the admin key"
            tenant = httpx.get(gw.base + path, headers={"Authorization": "Bearer tenant"}, timeout=10)
            assert tenant.status_code == 403, path
            for auth in ("Bearer admin-secret", basic):
                assert httpx.get(gw.base + path, headers={"Authorization": auth}, timeout=10).status_code == 200
            shut = httpx.get(closed.base + path, headers={"Authorization": "Bearer tenant"}, timeout=10)
            assert shut.status_code == 403 and "admin key" in shut.json()["error"]["message"], path
        # the API itself is the tenants': the admin key is not one of theirs
        assert ask(client(gw, "tenant"))[0]
        with pytest.raises(openai.AuthenticationError):
            ask(client(gw, "admin-secret"))
        assert httpx.get(gw.base + "/health", timeout=10).status_code == 200  # probes carry no key
    finally:
        gw.stop()
        closed.stop()


def test_probes_that_time_out_do_not_refuse_traffic_the_replica_serves(tmp_path, replicas):
    """Every probe times out (a 1 ms budget), as one does under a full batch: the replica still gets the
    requests and answers them, none refused with 503."""
    config = gateway_config(urls(replicas[:1]))
    config["health"] = {"interval": 0.2, "timeout": 0.001}
    gw = GatewayProcess(tmp_path, config)
    try:
        c = client(gw)
        for i in range(6):
            text, _ = ask(c, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=4)
            assert text
            time.sleep(0.3)  # probes keep failing in between
        assert "NOT ready" in gw.log() or gw.total("llmserve:gateway_replica_healthy") == 0
        assert gw.total("llmserve:gateway_requests_total") == 6
    finally:
        gw.stop()


def hang_up(gw: GatewayProcess, body: dict, after_s: float) -> None:
    """Send a chat request and close the connection `after_s` later, whatever has come back by then."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after_s)


def test_outstanding_requests_return_to_zero_on_every_way_out(tmp_path, replicas):
    """Success, an upstream's 400, a retry off a dead replica, a client gone before the first byte (streamed or
    not) and one gone after it: each gives back its replica's slot."""
    dead = f"http://127.0.0.1:{free_port()}"
    gw = GatewayProcess(tmp_path, gateway_config([*urls(replicas[:1]), dead], balancing="round_robin",
                                                 cache={"exact": False}))
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0}
    try:
        c = client(gw)
        for _ in range(2):  # round robin: one of each pair meets the dead replica first and is retried
            assert ask(c, max_tokens=4)[0]
            assert ask(c, stream=True, max_tokens=4)[0]
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=-1)
        for stream in (False, True):  # gone before the first byte: a long answer, a client that hangs up at once
            hang_up(gw, {**body, "max_tokens": 400, "stream": stream, "ignore_eos": True}, after_s=0.05)
        with httpx.stream("POST", f"{gw.base}/v1/chat/completions", timeout=60,  # gone after the first byte
                          json={**body, "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 30
        while gw.total("llmserve:gateway_replica_outstanding_requests") != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gw.total("llmserve:gateway_replica_outstanding_requests") == 0, gw.metrics()
    finally:
        gw.stop()
