"""/v1/responses through the official client: string and item input, instructions, function tools and their
outputs, text.format, previous_response_id, max_output_tokens and usage, whole and streamed (the client's own
event accumulation checks the event sequence), and what is refused."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL, ServerProcess

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_in_and_out_equals_the_chat_answer(client: openai.OpenAI):
    r = client.responses.create(input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=12,
                                **GREEDY)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "Answer in one word."},
                                                    {"role": "user", "content": "Name a fruit."}], max_tokens=12,
                                          **GREEDY)
    assert r.output_text == chat.choices[0].message.content and r.id.startswith("resp_")
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_streamed_events_add_up_to_the_whole_response(client: openai.OpenAI):
    args = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
            "max_output_tokens": 10, **GREEDY}
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        events = list(stream)  # the client accumulates them into its snapshot as they come
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds.count("response.output_text.delta") > 1
    # ended by its budget, as the whole one: response.incomplete, as OpenAI's API sends it (else completed)
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


def test_a_function_tool_round_trip_whole_and_streamed(client: openai.OpenAI):
    args = {"input": "What is the weather in Paris right now?", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 60, **GREEDY}
    first = client.responses.create(**args)
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    with client.responses.stream(**args) as stream:
        kinds = [event.type for event in stream]
        streamed = [o for o in stream.get_final_response().output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(call.name, call.arguments)]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    # the tool's result goes back as an item, the conversation carried by previous_response_id
    second = client.responses.create(previous_response_id=first.id, tools=[WEATHER], max_output_tokens=30,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 degrees"}], **GREEDY)
    assert second.output and second.previous_response_id == first.id
    # the same conversation written out as items gives the same answer
    spelled = client.responses.create(tools=[WEATHER], max_output_tokens=30, **GREEDY, input=[
        {"role": "user", "content": args["input"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees"}])
    assert spelled.output_text == second.output_text


def test_text_format_json_schema(client: openai.OpenAI):
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12}}, "required": ["fruit"],
              "additionalProperties": False}
    r = client.responses.create(input="Name a fruit.", max_output_tokens=40, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "fruit", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "hi", "background": True}, 400, "background"),
])
def test_what_cannot_be_honoured_is_refused(server: ServerProcess, body, status, param):
    r = httpx.post(f"{server.base}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_an_openai_agents_agent_calls_its_tool_through_the_default_responses_model(server: ServerProcess):
    """openai-agents' Agent on its default model (OpenAIResponsesModel) with one function tool. The tool must be
    called with its argument; whether the small model then answers or calls it again until max_turns is the model's
    own choice, not a server defect, so either ending passes and any other failure does not."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return "Sunny, 21 degrees"

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120))
    agent = Agent(name="weather", instructions="Use the tool to answer.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60,
                                               parallel_tool_calls=False))
    try:
        result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
        assert isinstance(result.final_output, str)
    except MaxTurnsExceeded:
        pass  # the model kept calling the tool
    assert cities and all(isinstance(c, str) and c for c in cities)
