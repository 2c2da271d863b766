from __future__ import annotations

from llmserve.gateway.cache.keys import cache_keys, is_deterministic


def body(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is 2+3?"}], "temperature": 0, **kw}


def test_delivery_fields_do_not_change_the_key_and_everything_else_does():
    base = cache_keys("ns", "chat", body())
    assert cache_keys("ns", "chat", body(stream=True, stream_options={"include_usage": True})) == base
    # another end user (OpenAI's `user`) is another key and another semantic scope: nothing crosses between them
    carol, dan = cache_keys("ns", "chat", body(user="carol")), cache_keys("ns", "chat", body(user="dan"))
    assert len({base.exact, carol.exact, dan.exact}) == 3 and len({base.scope, carol.scope, dan.scope}) == 3
    for change in ({"max_tokens": 5}, {"top_p": 0.5}, {"seed": 1}, {"some_new_param": 1}, {"model": "other"}):
        assert cache_keys("ns", "chat", body(**change)).exact != base.exact
    assert cache_keys("other-ns", "chat", body()).exact != base.exact
    assert cache_keys("ns", "completions", body()).exact != base.exact


def test_scope_is_everything_but_the_last_user_message():
    a = cache_keys("ns", "chat", body())
    b = cache_keys("ns", "chat", body(messages=[{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "what's 2 + 3"}]))
    assert a.scope == b.scope and a.exact != b.exact and (a.query, b.query) == ("What is 2+3?", "what's 2 + 3")
    other_system = cache_keys("ns", "chat", body(messages=[{"role": "system", "content": "Be verbose."},
                                                           {"role": "user", "content": "What is 2+3?"}]))
    earlier_turns = cache_keys("ns", "chat", body(messages=[{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello"},
                                                            {"role": "user", "content": "What is 2+3?"}]))
    assert len({a.scope, other_system.scope, earlier_turns.scope, cache_keys("ns2", "chat", body()).scope}) == 4
    last_not_user = cache_keys("ns", "chat", body(messages=[{"role": "user", "content": "x"},
                                                            {"role": "assistant", "content": "y"}]))
    assert last_not_user.query is None and last_not_user.scope == last_not_user.exact


def test_deterministic():
    assert is_deterministic({"temperature": 0}) and is_deterministic({"temperature": 0.9, "seed": 3})
    assert not is_deterministic({}) and not is_deterministic({"temperature": 0.7})
