"""A property-based fuzzer (schemathesis) over the server's own OpenAPI schema, against a real server: valid and
schema-violating requests to every route; no 5xx, every status and body as documented, every error in OpenAI's
envelope, invalid data refused, and the server healthy and idle afterwards. Bounded: a fixed number of cases from
a fixed seed (reproducible in CI; set LLMSERVE_FUZZ_SEED for a fresh draw), outputs capped at a few tokens."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.server.conftest import ServerProcess

CASES = int(os.environ.get("LLMSERVE_FUZZ_CASES", "250"))
SEED = int(os.environ.get("LLMSERVE_FUZZ_SEED", "20261125"))
MAX_OUTPUT_TOKENS, MAX_CHOICES = 4, 2


def _bounded(body: object) -> None:
    """Cap the work a valid case asks for (tokens, choices); values the schema refuses are left as generated."""
    if not isinstance(body, dict):
        return
    for key, cap in (("max_tokens", MAX_OUTPUT_TOKENS), ("max_completion_tokens", MAX_OUTPUT_TOKENS),
                     ("max_output_tokens", MAX_OUTPUT_TOKENS), ("n", MAX_CHOICES), ("best_of", MAX_CHOICES),
                     ("min_tokens", 0)):
        value = body.get(key)
        if type(value) is int and value > cap:
            body[key] = cap
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # absent or null: no cap
        body["max_tokens"] = MAX_OUTPUT_TOKENS
    if body.get("max_output_tokens") is None:  # the Responses API's name (the other routes ignore it)
        body["max_output_tokens"] = MAX_OUTPUT_TOKENS


@pytest.mark.slow
def test_the_server_keeps_to_its_schema_under_fuzzing(server: ServerProcess):
    """Slow: schemathesis sends hundreds of generated requests to the float32 server."""
    schema = schemathesis.openapi.from_url(f"{server.base}/openapi.json")
    strategy = schema.as_strategy(GenerationMode.POSITIVE) | schema.as_strategy(GenerationMode.NEGATIVE)
    failures: list[str] = []

    @seed(SEED)
    @settings(max_examples=CASES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        _bounded(case.body)
        try:
            # every documented-but-semantically-refused request (an unknown model name, a prompt over the
            # context) is a valid 4xx here, so "valid data must be accepted" does not apply
            case.call_and_validate(base_url=server.base, excluded_checks=[positive_data_acceptance], timeout=60)
        except AssertionError as e:  # schemathesis' failures: collect them all, report at the end
            failures.append(f"{case.method} {case.path}: {str(e)[:1500]}")

    run()
    assert not failures, f"{len(failures)} failing case(s):\n\n" + "\n\n".join(failures[:5])
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
    m = server.wait_idle(60)
    assert m["llmserve:num_kv_blocks_free"] == m["llmserve:num_kv_blocks_total"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_the_schema_documents_every_answer_a_route_gives(server: ServerProcess, route):
    spec = httpx.get(f"{server.base}/openapi.json", timeout=10).json()
    responses = spec["paths"][route]["post"]["responses"]
    assert set(responses) == {"200", "400", "401", "404", "408", "413", "415", "429", "500", "503"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "422" not in str(spec)
