"""Structured outputs and tool calling as applications use them, through the official `openai` client against a
real server: parsed Pydantic answers, JSON schema / choice / regex on both endpoints, streamed equals whole,
tool calls and a round trip with a tool result, and every bad constraint refused with a 400 before any work."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from llmserve.engine.input_processor import InputProcessor
from llmserve.loader import load_tokenizer
from llmserve.server.protocol import ChatCompletionRequest
from llmserve.server.tool_calls import active_tools, chat_messages
from tests.model_files import needs_qwen
from tests.server.conftest import MODEL, ServerProcess
from tests.structured_output.test_constrained_decoding import FAILS_LATER, HUGE_SCHEMA

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


def joined_calls(deltas) -> list[tuple[str, str]]:
    """(name, arguments) of each streamed call, its pieces joined by index as OpenAI's clients join them."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for piece in delta.delta.tool_calls or []:
            name, arguments = calls.setdefault(piece.index, ["", ""])
            calls[piece.index] = [name + (piece.function.name or ""), arguments + (piece.function.arguments or "")]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_the_pydantic_model(client: openai.OpenAI):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)


def test_a_json_schema_answer_streams_as_it_answers_whole(client: openai.OpenAI, server: ServerProcess):
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 10},
                                                          "minItems": 2, "maxItems": 3}},
              "required": ["colors"], "additionalProperties": False}
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Name some colors."}], "temperature": 0,
            "max_tokens": 80, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "colors", "schema": schema}}}
    whole = client.chat.completions.create(**args).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True)
                       if c.choices)
    assert streamed == whole.message.content and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), schema)
    server.wait_idle()


def test_completions_take_every_constraint_spelling(client: openai.OpenAI):
    def text(**extra_body) -> str:
        return client.completions.create(model=MODEL, prompt="Is water wet? Answer:", temperature=0, max_tokens=20,
                                         extra_body=extra_body).choices[0].text

    assert text(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
    assert text(guided_choice=["maybe", "never"]) in ("maybe", "never")
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", text(guided_regex="[0-9]{2}:[0-9]{2}"))
    assert isinstance(json.loads(text(guided_json={"type": "object", "properties": {"a": {"type": "boolean"}},
                                                   "required": ["a"], "additionalProperties": False})), dict)
    assert text(guided_grammar='start: "A" | "B"') in ("A", "B")


def test_sampled_choices_each_follow_the_schema(client: openai.OpenAI):
    schema = {**Person.model_json_schema(), "additionalProperties": False}  # as parse() sends it
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person, please."}],
                                       n=3, seed=11, temperature=1.0, top_p=0.9, max_tokens=100,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "p", "schema": schema, "strict": True}})
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        Person.model_validate_json(choice.message.content)


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}}, "response_format",
     "look-around"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "give one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_grammar": "start: missing"}, "guided_grammar", "missing"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "nope"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice", "give one"),
    ({"guided_grammar": "start: start"}, "guided_grammar", "no text satisfies it"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format", "no text satisfies it"),
    ({"guided_regex": "a{1000000}"}, "guided_regex", "too many expressions"),
    ({"guided_choice": [f"c{i}" for i in range(50_000)]}, "guided_choice", "KiB"),
    ({"guided_json": HUGE_SCHEMA}, "guided_json", "KiB"),
])
def test_bad_constraints_are_400_and_change_nothing(server: ServerProcess, body, param, needle):
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and (error["param"] or "").startswith(param), error
    assert "backtrace" not in error["message"] and "\n" not in error["message"]
    assert server.wait_idle()["llmserve:num_requests_running"] == 0
    ok = httpx.post(f"{server.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_a_constraint_that_fails_while_decoding_is_an_error_whole_and_streamed(server: ServerProcess):
    """Never a 200 with `stop`: whole, a 400 envelope; streamed, an error event and [DONE]; counted in /metrics."""
    before = server.metrics().get("llmserve:request_failure_total", 0.0)
    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "guided_regex": FAILS_LATER}
    whole = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 400, whole.text
    error = whole.json()["error"]
    assert error["code"] == "constraint_failed" and "too many expressions" in error["message"], error
    with httpx.stream("POST", f"{server.base}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "constraint_failed"
    assert not any('"finish_reason":"stop"' in e.replace(" ", "") for e in events)
    after = server.wait_idle()
    assert after["llmserve:request_failure_total"] == before + 2
    assert after["llmserve:num_kv_blocks_free"] == after["llmserve:num_kv_blocks_total"]


def test_required_tool_call_whole_and_streamed(client: openai.OpenAI):
    args = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
            "max_tokens": 60, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    deltas = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    pieces = [t for d in deltas for t in d.delta.tool_calls or []]
    assert joined_calls(deltas) == [(call.function.name, call.function.arguments)]
    assert len(pieces) > 2 and pieces[0].id and all(p.id is None and p.function.name is None for p in pieces[1:])
    assert deltas[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_response_format_beside_tools_is_a_call_or_an_answer_in_the_format(client: openai.OpenAI, tool_choice):
    """As OpenAI's API: with tool_choice auto the model may call a tool or answer in the format (never text that is
    neither); a forced call takes precedence, the format being for a later answer."""
    schema = {"type": "object", "properties": {"forecast": {"type": "string", "maxLength": 20}},
              "required": ["forecast"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                       temperature=0, max_tokens=60, parallel_tool_calls=False,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "forecast", "schema": schema}})
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert tool_choice == "auto" and choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_tool_result_round_trip(client: openai.OpenAI):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    [call] = message.tool_calls
    follow_up = [*ASK, message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}]
    second = client.chat.completions.create(model=MODEL, messages=follow_up, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=30)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


@needs_qwen
def test_qwen_renders_the_conversation_as_its_template_expects():
    """A template that renders tools (Qwen2.5's) gets them, the earlier call with its arguments as an object, and
    the tool's result as a <tool_response> turn: the very text Qwen was trained on."""
    tokenizer = load_tokenizer("qwen2.5-coder-0.5b")
    processor = InputProcessor(tokenizer, tokenizer.chat_template, 151936, 1024, 4096)
    request = ChatCompletionRequest(tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"}])
    tools = active_tools(request)
    messages = chat_messages(request.messages, [m.content or "" for m in request.messages], tools,
                             processor.template_renders_tools)
    text = processor.render_chat(messages, tools=[t.model_dump(exclude_none=True) for t in tools])
    assert '"name": "get_weather", "description": "The current weather in a city"' in text
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                         '"Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 21 degrees\n'
                         '</tool_response><|im_end|>\n<|im_start|>assistant\n')


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory) -> ServerProcess:
    proc = ServerProcess(tmp_path_factory.mktemp("qwen") / "qwen.log", "--model", "qwen2.5-coder-0.5b")
    try:
        proc.wait_ready(300)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def qwen(qwen_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen_server.base}/v1", api_key="unused", max_retries=0, timeout=300)


@needs_qwen
def test_qwen_calls_a_tool_by_itself(qwen: openai.OpenAI):
    """tool_choice auto: Qwen2.5-Coder-0.5B decides to call the tool (it writes the call's JSON without the tags,
    which counts), whole and streamed alike; the conversation goes on with the tool's result."""
    args = {"model": "qwen2.5-coder-0.5b", "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 60}
    first = qwen.chat.completions.create(**args).choices[0]
    assert first.finish_reason == "tool_calls", first.message
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    deltas = [c.choices[0] for c in qwen.chat.completions.create(**args, stream=True) if c.choices]
    assert joined_calls(deltas) == [("get_weather", call.function.arguments)]
    assert not "".join(d.delta.content or "" for d in deltas) and deltas[-1].finish_reason == "tool_calls"
    follow_up = [*ASK, first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius"}]
    second = qwen.chat.completions.create(**{**args, "messages": follow_up}).choices[0]
    assert second.finish_reason in ("stop", "length", "tool_calls")


@needs_qwen
@pytest.mark.parametrize("forced", [
    {"tool_choice": "required"},
    {"tool_choice": "required", "parallel_tool_calls": True},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
], ids=["required", "required-parallel", "named"])
def test_qwen_forced_tool_calls_are_calls_whole_and_streamed(qwen: openai.OpenAI, forced):
    """What instructor, pydantic-ai, langchain and llama-index send: the grammar's tags are Qwen's own tag tokens,
    so the call comes out whole (not one token and a `stop`), and streamed as whole."""
    args = {"model": "qwen2.5-coder-0.5b", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "temperature": 0, "max_tokens": 60, **forced}
    whole = qwen.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls and whole.usage.completion_tokens > 5
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    deltas = [c.choices[0] for c in qwen.chat.completions.create(**args, stream=True) if c.choices]
    assert joined_calls(deltas) == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls"


@needs_qwen
def test_qwen_regex_with_the_tag_as_text(qwen_server: ServerProcess):
    r = httpx.post(f"{qwen_server.base}/v1/chat/completions", timeout=120, json={
        "model": "qwen2.5-coder-0.5b", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 12, "temperature": 0, "guided_regex": "<tool_call>[a-z]+"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert re.fullmatch("<tool_call>[a-z]+", choice["message"]["content"]), choice
    assert choice["finish_reason"] in ("stop", "length")
