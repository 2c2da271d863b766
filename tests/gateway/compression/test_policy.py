"""The compression policy: the YAML's, and a request's `compress` over it."""

import pytest

from llmserve.gateway.compression.policy import CompressPolicy, request_policy
from llmserve.gateway.config import load_config


def test_a_request_changes_the_models_policy():
    model = CompressPolicy(scorer="small", rate=0.6, min_tokens=400)
    assert request_policy(model, None) is model
    assert request_policy(model, False) is None
    assert request_policy(model, True) is model
    assert request_policy(None, True) == CompressPolicy()  # no scorer: the compressor says so
    assert request_policy(model, {"rate": 0.3}) == CompressPolicy(scorer="small", rate=0.3, min_tokens=400)
    assert model.context == ("documents", "turns")  # instructions are not compressed unless named
    assert request_policy(model, {"context": ["documents", "system"]}).context == ("documents", "system")
    for bad in ({"rate": 0}, {"rate": 1.5}, {"rate": "half"}, {"min_tokens": -1}, {"speed": 2}, "yes", 3,
                {"context": []}, {"context": ["tools"]}):
        with pytest.raises(ValueError):
            request_policy(model, bad)


def test_the_yaml_policy_names_a_scorer_among_the_models(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text("models:\n  big: {upstreams: [http://127.0.0.1:1], compress: {scorer: small, rate: 0.5}}\n"
                    "  small: {upstreams: [http://127.0.0.1:2]}\n")
    config = load_config(path)
    assert config.models["big"].compress == CompressPolicy(scorer="small", rate=0.5)
    assert config.models["small"].compress is None
    path.write_text("models:\n  big: {upstreams: [http://127.0.0.1:1], compress: {scorer: nope}}\n")
    with pytest.raises(ValueError, match="compress.scorer"):
        load_config(path)
    path.write_text("models:\n  big: {upstreams: [http://127.0.0.1:1], compress: {rate: 2}}\n")
    with pytest.raises(ValueError, match="models.big.compress: rate"):
        load_config(path)
