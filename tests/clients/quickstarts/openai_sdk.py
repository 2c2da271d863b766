"""The official `openai` client's quick-start (2.x and 3.x): chat, stream, `parse` with a Pydantic model, one tool
(forced, then its result sent back), and the Responses API."""

from __future__ import annotations

import json

import openai
from harness import (
    MAX_TOKENS,
    QUESTION,
    STRUCTURED,
    TOOL_QUESTION,
    WEATHER_TOOL,
    City,
    arguments,
    check,
    expect_model,
    finish,
    get_weather,
    run,
)

args = arguments()
client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
common = {"model": args.model, "temperature": 0, "max_tokens": MAX_TOKENS}
ask = [{"role": "user", "content": QUESTION}]


def chat() -> str:
    answer = client.chat.completions.create(messages=ask, **common)
    check(bool(answer.choices[0].message.content), "empty answer")
    return answer.choices[0].message.content


def stream() -> str:
    chunks = list(client.chat.completions.create(messages=ask, stream=True, **common))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == chat(), "the stream's text differs from the answer's")
    return text


def structured() -> str:
    parsed = client.chat.completions.parse(messages=[{"role": "user", "content": STRUCTURED}], response_format=City,
                                           **{**common, "max_tokens": 64}).choices[0].message.parsed
    check(isinstance(parsed, City), f"not parsed: {parsed!r}")
    return parsed.model_dump_json()


def tool() -> str:
    messages = [{"role": "user", "content": TOOL_QUESTION}]
    first = client.chat.completions.create(messages=messages, tools=[WEATHER_TOOL], tool_choice="required", **common)
    call = first.choices[0].message.tool_calls[0]
    check(call.function.name == "get_weather", f"called {call.function.name}")
    result = get_weather(**json.loads(call.function.arguments))
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(messages=messages, tools=[WEATHER_TOOL], **common).choices[0]
    expect_model(final.finish_reason == "stop" and bool(final.message.content),
                 f"after the tool's result the model went on with {final.message}")
    return final.message.content


def responses() -> str:
    answer = client.responses.create(model=args.model, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    check(bool(answer.output_text), f"no text: {answer}")
    events = list(client.responses.create(model=args.model, input=QUESTION, max_output_tokens=MAX_TOKENS,
                                          temperature=0, stream=True))
    check("".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text,
          "the Responses stream's text differs from the answer's")
    return answer.output_text


finish(run("openai", {"chat": chat, "stream": stream, "structured": structured, "tool": tool,
                      "responses": responses}))
