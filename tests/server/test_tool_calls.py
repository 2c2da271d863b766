"""Tool calls parsed from the Hermes format, whole and streamed in any split; the prompt a template without
tool support gets; the grammar that `tool_choice` required / named imposes."""

from __future__ import annotations

import json

import pytest

from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest
from llmserve.server.tool_calls import ToolCallParser, active_tools, chat_messages, tool_call_constraint

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}
OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "Weather in Paris?"}], **extra})


def test_a_whole_output_splits_into_content_and_calls():
    content, calls = ToolCallParser(NAMES).parse(OUTPUT)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_in_any_split_gives_the_same_result(size):
    parser = ToolCallParser(NAMES)
    content, names = "", []
    for start in range(0, len(OUTPUT), size):
        text, calls = parser.feed(OUTPUT[start:start + size])
        content += text
        names += [c.function.name for c in calls]
    rest, calls = parser.finish()
    assert (content + rest).strip() == "Let me check." and names + [c.function.name for c in calls] == [
        "get_weather", "get_time"]


def test_a_call_in_progress_streams_its_arguments_as_written():
    """The pieces `in_progress` gives are prefixes of the whole call's own arguments text (not a re-serialisation),
    under the id the whole call then has."""
    arguments = '{"city":  "Paris", "note": "a \\"} b"}'  # odd spacing, an escaped quote and a brace in a string
    written = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    parser = ToolCallParser(NAMES)
    seen: list[tuple[str, str, str]] = []
    calls = []
    for start in range(0, len(written), 3):
        calls += parser.feed(written[start:start + 3])[1]
        if (progress := parser.in_progress()) is not None:
            seen.append(progress)
    calls += parser.finish()[1]
    [call] = calls
    assert call.function.arguments == arguments and json.loads(arguments)["note"] == 'a "} b'  # as written
    assert {(i, name) for i, name, _ in seen} == {(call.id, "get_weather")}
    prefixes = [so_far for _, _, so_far in seen]
    assert prefixes == sorted(prefixes, key=len) and len(set(prefixes)) > 5
    assert all(call.function.arguments.startswith(p) for p in prefixes) and prefixes[-1] == call.function.arguments
    assert ToolCallParser(NAMES).parse(written)[1][0].function.arguments == call.function.arguments


def test_text_that_only_looks_like_a_call_stays_content():
    assert ToolCallParser(NAMES).parse("a < b and <tool_ is not a tag") == ("a < b and <tool_ is not a tag", [])
    assert ToolCallParser(NAMES).parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    # a call cut off by max_tokens is not a call
    content, calls = ToolCallParser(NAMES).parse('<tool_call>\n{"name": "get_weather", "argu')
    assert calls == [] and content.startswith("<tool_call>")
    # but one whose closing tag alone is missing is
    content, calls = ToolCallParser(NAMES).parse('<tool_call>\n{"name": "get_time", "arguments": {}}')
    assert content is None and calls[0].function.name == "get_time"


def test_templates_without_tools_get_them_in_the_system_message():
    request = _request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain"}])
    texts = [m.content or "" for m in request.messages]
    messages = chat_messages(request.messages, texts, active_tools(request), template_has_tools=False)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                           '{"city": "Oslo"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nRain\n</tool_response>"}
    # a template that renders tools gets the calls as objects, the arguments parsed
    native = chat_messages(request.messages, texts, active_tools(request), template_has_tools=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[3] == {"role": "tool", "content": "Rain", "tool_call_id": "call_1"}


def test_tool_choice_decides_the_constraint():
    assert tool_call_constraint(_request(tools=[WEATHER]), [WEATHER]) is None  # auto: free
    request = _request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    tools = active_tools(request)
    grammar = tool_call_constraint(request, tools).grammar
    assert "get_time" in grammar and "get_weather" not in grammar and "call)*" not in grammar
    required = _request(tools=[WEATHER, TIME], tool_choice="required")
    assert '("\\n" call)*' in tool_call_constraint(required, active_tools(required)).grammar
    single = _request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert "call)*" not in tool_call_constraint(single, active_tools(single)).grammar
    assert active_tools(_request(tools=[WEATHER], tool_choice="none")) == []
    # auto beside a JSON response_format: calls, or an answer in the format
    formatted = _request(tools=[WEATHER], response_format={"type": "json_object"})
    grammar = tool_call_constraint(formatted, active_tools(formatted)).grammar
    assert grammar.startswith('start: call ("\\n" call)* | %json {"type": "object"}') and "get_weather" in grammar
    assert tool_call_constraint(_request(tools=[WEATHER], response_format={"type": "text"}), [WEATHER]) is None


@pytest.mark.parametrize(("extra", "message"), [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
])
def test_impossible_tool_choices_are_refused(extra, message):
    with pytest.raises(APIError, match=message):
        active_tools(_request(**extra))


def test_an_output_that_is_only_a_calls_json_is_a_call():
    """Small models often leave the tags out: the bare JSON of a call to an offered function is a call (whole and
    streamed); JSON that names no offered function, or is not JSON, stays content."""
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    content, calls = ToolCallParser({"get_weather"}).parse(bare)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')]
    parser = ToolCallParser({"get_weather"})
    assert [parser.feed(piece) for piece in (" ", bare[:10], bare[10:])] == [("", [])] * 3  # held to the end
    assert parser.finish()[1][0].function.name == "get_weather"
    assert ToolCallParser({"get_weather"}).parse('[{"name": "get_weather", "arguments": {}}]')[1][0].function.name \
        == "get_weather"
    # one per line, as Qwen2.5-Coder-0.5B writes several: each a call, whole and streamed alike
    lines = f"{bare}\n" + bare.replace("Paris", "Rome") + "\n"
    content, calls = ToolCallParser({"get_weather"}).parse(lines)
    assert content is None and [c.function.arguments for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']
    parser = ToolCallParser({"get_weather"})
    assert [parser.feed(piece) for piece in (lines[:30], lines[30:])] == [("", [])] * 2
    assert [c.function.arguments for c in parser.finish()[1]] == ['{"city": "Paris"}', '{"city": "Rome"}']
    assert ToolCallParser({"get_weather"}).parse(bare + "\nThat is all.") == (bare + "\nThat is all.", [])
    for text in ('{"name": "send_mail", "arguments": {}}', '{"answer": 42}', "{ not json", ' [1, 2]'):
        assert ToolCallParser({"get_weather"}).parse(text) == (text, [])
    parser = ToolCallParser({"get_weather"})
    assert parser.feed("Sure") == ("Sure", [])  # prose streams at once
