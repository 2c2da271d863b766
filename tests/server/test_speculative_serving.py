"""`llmserve serve --speculative-config`: streams carry several tokens a step and still join to the
non-stream text; the default server's greedy text is unchanged; the counters reach /metrics and the log."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import MODEL, ServerProcess

CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n" \
       "    return 2 * (width + height)\n"
MESSAGES = [{"role": "user", "content": f"Repeat this code exactly, then explain it:\n\n{CODE}"}]
GREEDY = {"temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    config = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    proc = ServerProcess(tmp_path_factory.mktemp("spec") / "server.log", "--speculative-config", json.dumps(config))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_speculative_text_streams_and_equals_the_plain_servers(spec_server: ServerProcess,
                                                              server: ServerProcess) -> None:
    spec, plain = (openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0, timeout=120)
                   for s in (spec_server, server))
    whole = spec.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert whole.choices[0].message.content == \
        plain.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY).choices[0].message.content
    chunks = list(spec.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # several tokens arrived together: fewer content chunks than tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) < whole.usage.completion_tokens
    metrics = spec_server.wait_idle()
    assert metrics["llmserve:spec_decode_num_drafts_total"] > 0
    assert 0 < metrics["llmserve:spec_decode_num_accepted_tokens_total"] <= \
        metrics["llmserve:spec_decode_num_draft_tokens_total"]
    assert 1 < metrics["llmserve:spec_decode_mean_acceptance_length"] <= 5
    assert "speculative: acceptance" in spec_server.log()


@pytest.mark.processes
def test_a_bad_speculative_config_stops_the_server_with_its_reason(tmp_path) -> None:
    proc = ServerProcess(tmp_path / "server.log", "--speculative-config", '{"method": "medusa"}')
    with pytest.raises(RuntimeError, match="not supported yet"):
        proc.wait_ready()
    assert proc.stop() != 0
