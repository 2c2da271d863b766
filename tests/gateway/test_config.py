from __future__ import annotations

import pytest

from llmserve.gateway.config import load_config, parse_upstream


def test_flags_and_file_merge(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTED_KEY", "sk-test")
    monkeypatch.setenv("TEAM_KEY", "team-secret")
    path = tmp_path / "gw.yaml"
    path.write_text("""
models:
  big: {upstreams: [http://a:1/, http://b:2], balancing: prefix_aware, api_key_env: HOSTED_KEY,
        health_path: /v1/models}
keys:
  - {key_env: TEAM_KEY, namespace: team, requests_per_minute: 5}
cache: {ttl: 60, semantic: true}
retries: 1
""")
    config = load_config(path, models={"small": parse_upstream("small=http://c:3")}, cache={"ttl": 30.0})
    assert config.models["big"].upstreams == ("http://a:1", "http://b:2")
    assert config.models["big"].api_key == "sk-test" and config.models["big"].health_path == "/v1/models"
    assert config.models["small"].balancing == "least_outstanding"
    assert config.key_table()["team-secret"].namespace == "team"
    assert (config.cache.ttl, config.cache.semantic, config.retries) == (30.0, True, 1)


def test_each_key_has_its_own_namespace_unless_keys_share_one_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("ADMIN", "admin-secret")
    path = tmp_path / "gw.yaml"
    path.write_text("""
models: {m: {upstreams: [http://a]}}
keys: [{key: kc}, {key: kd}, {key: k1, namespace: team}, {key: k2, namespace: team}]
admin_key_env: ADMIN
""")
    config = load_config(path)
    table = config.key_table()
    assert table["kc"].namespace != table["kd"].namespace  # named by a digest, never by the key itself
    assert all("kc" not in table[k].namespace for k in ("kc", "kd"))
    assert table["k1"].namespace == table["k2"].namespace == "team"
    assert config.shared_namespaces() == {"team": 2}
    assert config.admin_key == "admin-secret" and config.admin_protected
    assert not load_config(path, open_admin=True).admin_protected
    assert not load_config(None, models={"m": parse_upstream("m=http://a")}).admin_protected  # no keys: open


@pytest.mark.parametrize("text, message", [
    ("models: {m: {upstreams: [http://a]}}\nbogus: 1", "unknown gateway setting"),
    ("models: {m: {upstreams: [http://a], weight: 2}}", "models.m: unknown setting"),
    ("models: {m: {upstreams: [ftp://a]}}", "not an http"),
    ("models: {m: {upstreams: [http://a], balancing: random}}", "balancing must be one of"),
    ("models: {m: {upstreams: [http://a], api_key_env: SURELY_UNSET_VAR}}", "SURELY_UNSET_VAR, which is not set"),
    ("models: {m: {upstreams: []}}", "no upstreams"),
    ("models: {m: {upstreams: [http://a]}}\ncache: {semantic_threshold: 1.5}", "semantic_threshold"),
    ("keys: [{namespace: x}]\nmodels: {m: {upstreams: [http://a]}}", "needs 'key'"),
    ("{}", "no models"),
    ("models: {m: {prefill: [http://p]}}", "prefill without decode"),
    ("models: {m: {upstreams: [http://a], decode: [http://d]}}", "decode without prefill"),
    ("models: {m: {prefill: [http://p], decode: []}}", "prefill without decode"),
    ("models: {m: {prefill: [ftp://p], decode: [http://d]}}", "prefill 'ftp://p' is not an http"),
    ("models: {m: {prefill: [http://p], decode: [p:1]}}", "decode 'p:1' is not an http"),
    ("models: {m: {prefill: [http://p], decode: [http://d]}, m/decode: {upstreams: [http://a]}}", "m/decode"),
])
def test_bad_config_is_refused_with_a_clear_message(tmp_path, text, message):
    path = tmp_path / "gw.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_prefill_and_decode_replicas(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("""
models:
  pd: {prefill: [http://p:1/], decode: [http://d:1, http://d:2/]}
  pd-with-fallback: {prefill: http://p:2, decode: http://d:3, upstreams: [http://b:1]}
  plain: {upstreams: [http://a:1]}
""")
    models = load_config(path).models
    assert (models["pd"].prefill, models["pd"].decode, models["pd"].upstreams) == (
        ("http://p:1",), ("http://d:1", "http://d:2"), ())  # no upstreams needed with both
    assert (models["pd-with-fallback"].prefill, models["pd-with-fallback"].decode,
            models["pd-with-fallback"].upstreams) == (("http://p:2",), ("http://d:3",), ("http://b:1",))
    assert (models["plain"].prefill, models["plain"].decode) == ((), ())


def test_upstream_flag():
    route = parse_upstream("m=http://a:1/,http://b:2", "round_robin")
    assert (route.name, route.upstreams, route.balancing) == ("m", ("http://a:1", "http://b:2"), "round_robin")
    with pytest.raises(ValueError, match="NAME=URL"):
        parse_upstream("http://a:1")
