"""The official `openai` client driven through every parameter of chat and completions it documents, streamed and
not, against a real server: each answer is validated against the client's own response types (their required
fields and types, not just parsed leniently as the client does), and a parameter the server cannot honour is a 400
naming it, never silently ignored."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.server.conftest import MODEL, ServerProcess

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# every parameter of client.chat.completions.create; (kwargs, refused parameter or None)
CHAT_PARAMETERS = [
    ({"frequency_penalty": 0.5}, None),
    ({"presence_penalty": -0.5}, None),
    ({"logit_bias": {}}, None),
    ({"logit_bias": {"15": 5}}, None),
    ({"logprobs": True, "top_logprobs": 3}, None),
    ({"max_completion_tokens": 3}, None),
    ({"max_tokens": 3}, None),
    ({"n": 2, "seed": 5, "temperature": 0.8}, None),
    ({"stop": ["\n", "."]}, None),
    ({"stream_options": {"include_usage": True}, "stream": True}, None),
    ({"temperature": 0.0, "top_p": 0.5}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "fruit", "strict": True, "schema": {
        "type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12}}, "required": ["fruit"],
        "additionalProperties": False}}}}, None),
    ({"tools": [WEATHER]}, None),
    ({"tools": [WEATHER], "tool_choice": "none"}, None),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, None),
    ({"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
      "prompt_cache_key": "k", "reasoning_effort": "low", "verbosity": "low"}, None),
    ({"prediction": {"type": "content", "content": "Apple"}}, None),
    ({"modalities": ["text"]}, None),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"web_search_options": {}}, "web_search_options"),
]
COMPLETION_PARAMETERS = [
    ({"best_of": 2, "n": 2, "seed": 3, "temperature": 0.7}, None),
    ({"best_of": 3, "n": 1}, "best_of"),
    ({"echo": True, "logprobs": 2}, None),
    ({"frequency_penalty": 1.0, "presence_penalty": 1.0}, None),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"max_tokens": 2}, None),
    ({"stop": "."}, None),
    ({"stream_options": {"include_usage": True}, "stream": True}, None),
    ({"suffix": "!"}, "suffix"),
    ({"temperature": 0.0, "top_p": 0.9, "user": "u"}, None),
    ({"extra_body": {"structured_outputs": {"regex": "[a-z]{3,6}"}}}, None),
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_chat(client: openai.OpenAI, kwargs: dict) -> None:
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **kwargs}
    if not base.get("stream"):
        raw = client.chat.completions.with_raw_response.create(**base)
        body = json.loads(raw.text)
        answer = ChatCompletion.model_validate(body)  # the client's types, validating
        assert answer.object == "chat.completion" and len(answer.choices) == base.get("n", 1)
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
        for choice in answer.choices:
            assert choice.finish_reason in ("stop", "length", "tool_calls")
            assert (choice.message.content is not None) or choice.message.tool_calls
            if kwargs.get("logprobs"):
                assert choice.logprobs.content and all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    streamed = {**base, "stream": True}
    chunks = [ChatCompletionChunk.model_validate(c.model_dump()) for c in client.chat.completions.create(**streamed)]
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert len(finishes) == base.get("n", 1)
    if kwargs.get("stream_options", {}).get("include_usage"):
        assert chunks[-1].usage is not None and chunks[-1].choices == []


@pytest.mark.parametrize(("kwargs", "refused"), CHAT_PARAMETERS, ids=lambda v: ",".join(v) if isinstance(v, dict)
                         else str(v))
@pytest.mark.slow
def test_chat_parameters(client: openai.OpenAI, kwargs, refused):
    """Slow: every chat parameter, streamed and not (the fast tier's API tests take the common ones)."""
    if refused is None:
        _check_chat(client, kwargs)
        return
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=stream, **kwargs)
        assert e.value.body["param"] == refused, e.value.body


@pytest.mark.parametrize(("kwargs", "refused"), COMPLETION_PARAMETERS,
                         ids=lambda v: ",".join(v) if isinstance(v, dict) else str(v))
@pytest.mark.slow
def test_completion_parameters(client: openai.OpenAI, kwargs, refused):
    """Slow: every completion parameter, streamed and not (the fast tier's API tests take the common ones)."""
    base = {"model": MODEL, "prompt": "Fruits: apple, pear,", "max_tokens": 8, **kwargs}
    if refused is not None:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**base)
        assert e.value.body["param"] == refused
        return
    if not base.get("stream"):
        body = json.loads(client.completions.with_raw_response.create(**base).text)
        answer = Completion.model_validate(_without_echo_nulls(body))
        assert answer.object == "text_completion" and len(answer.choices) == base.get("n", 1)
        if kwargs.get("echo"):
            assert answer.choices[0].text.startswith(base["prompt"])
            assert len(answer.choices[0].logprobs.tokens) == len(answer.choices[0].logprobs.token_logprobs)
    raw = [c.model_dump() for c in client.completions.create(**{**base, "stream": True})]
    # OpenAI's own streams carry finish_reason null until a choice ends, which the client's type (shared with
    # whole answers) does not allow: count the finishes, then validate the rest of each chunk
    assert len([ch for c in raw for ch in c["choices"] if ch["finish_reason"]]) == base.get("n", 1)
    chunks = [Completion.model_validate(_without_echo_nulls({**c, "choices": [
        {**ch, "finish_reason": ch["finish_reason"] or "length"} for ch in c["choices"]]})) for c in raw]
    if kwargs.get("stream_options", {}).get("include_usage"):
        assert chunks[-1].usage is not None and chunks[-1].choices == []


def _without_echo_nulls(body: dict) -> dict:
    """OpenAI's echo answers score the first prompt token as null (nothing precedes it), as ours do; the client's
    type has no room for that null, so it is set aside before the rest is validated."""
    for choice in body["choices"]:
        lps = choice.get("logprobs")
        if lps and lps["token_logprobs"] and lps["token_logprobs"][0] is None:
            lps["token_logprobs"][0], lps["top_logprobs"][0] = 0.0, {}
    return body


def test_models_and_errors_have_the_clients_shapes(client: openai.OpenAI):
    models = client.models.list()
    assert [m.id for m in models.data][0] == MODEL and all(m.object == "model" for m in models.data)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="not-served", messages=MESSAGES)
    assert set(e.value.body) == {"message", "type", "param", "code"} and e.value.body["code"] == "model_not_found"
    one = client.models.retrieve(MODEL)
    assert (one.id, one.object) == (MODEL, "model") and one.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("not-served")
    assert e.value.body["code"] == "model_not_found"


def test_every_answer_carries_a_request_id(client: openai.OpenAI, server: ServerProcess):
    """The client's own x-request-id where it sent one (so its logs and ours name the same request), else a new
    one each time; errors and gate refusals included."""
    mine = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                           extra_headers={"x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    fresh = [client.models.with_raw_response.list().headers["x-request-id"] for _ in range(2)]
    assert len(set(fresh)) == 2 and all(fresh)
    refused = httpx.post(f"{server.base}/v1/completions", content=b"x" * 10, timeout=30,
                         headers={"content-type": "text/plain", "x-request-id": "bad id with spaces"})
    assert refused.status_code == 415 and refused.headers["x-request-id"] not in ("", "bad id with spaces")
