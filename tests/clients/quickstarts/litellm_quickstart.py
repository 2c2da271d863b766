"""litellm's quick-start against an OpenAI-compatible server (`openai/<model>` with `api_base`): chat, stream,
`response_format` with a Pydantic model, and one tool (forced, then its result sent back)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list, without fetching it

import litellm  # noqa: E402
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
common = {"model": f"openai/{args.model}", "api_base": args.base_url, "api_key": args.api_key, "temperature": 0,
          "max_tokens": MAX_TOKENS, "num_retries": 0, "timeout": 300}
ask = [{"role": "user", "content": QUESTION}]


def chat() -> str:
    text = litellm.completion(messages=ask, **common).choices[0].message.content
    check(bool(text), "empty answer")
    return text


def stream() -> str:
    text = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(messages=ask, stream=True,
                                                                                        **common))
    check(text == chat(), "the stream's text differs from the answer's")
    return text


def structured() -> str:
    answer = litellm.completion(messages=[{"role": "user", "content": STRUCTURED}], response_format=City,
                                **{**common, "max_tokens": 64})
    return City.model_validate_json(answer.choices[0].message.content).model_dump_json()


def tool() -> str:
    messages = [{"role": "user", "content": TOOL_QUESTION}]
    first = litellm.completion(messages=messages, tools=[WEATHER_TOOL], tool_choice="required", **common)
    call = first.choices[0].message.tool_calls[0]
    check(call.function.name == "get_weather", f"called {call.function.name}")
    result = get_weather(**json.loads(call.function.arguments))
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = litellm.completion(messages=messages, tools=[WEATHER_TOOL], **common).choices[0]
    expect_model(final.finish_reason == "stop" and bool(final.message.content),
                 f"after the tool's result the model went on with {final.message}")
    return final.message.content


finish(run("litellm", {"chat": chat, "stream": stream, "structured": structured, "tool": tool}))
