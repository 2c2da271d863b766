"""pydantic-ai's quick-start: an Agent on `OpenAIChatModel` (run, run_stream), a Pydantic output type in its
default mode (a forced output tool), and a function tool the agent calls and answers from."""

from __future__ import annotations

import asyncio

from harness import (
    MAX_TOKENS,
    QUESTION,
    STRUCTURED,
    TOOL_QUESTION,
    City,
    arguments,
    check,
    expect_model,
    finish,
    get_weather,
    run,
)
from pydantic_ai import Agent
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

args = arguments()
model = OpenAIChatModel(args.model, provider=OpenAIProvider(base_url=args.base_url, api_key=args.api_key))
settings = {"temperature": 0, "max_tokens": MAX_TOKENS}


def chat() -> str:
    text = Agent(model, model_settings=settings).run_sync(QUESTION).output
    check(bool(text), "empty answer")
    return text


def stream() -> str:
    async def streamed() -> str:
        async with Agent(model, model_settings=settings).run_stream(QUESTION) as result:
            return "".join([delta async for delta in result.stream_text(delta=True)])

    text = asyncio.run(streamed())
    check(text == chat(), "the stream's text differs from the answer's")
    return text


def structured() -> str:
    city = Agent(model, output_type=City, model_settings={**settings, "max_tokens": 64}).run_sync(STRUCTURED).output
    check(isinstance(city, City), f"not a City: {city!r}")
    return city.model_dump_json()


def tool() -> str:
    agent = Agent(model, tools=[get_weather], model_settings=settings)
    result = agent.run_sync(TOOL_QUESTION, usage_limits=UsageLimits(request_limit=4))
    called = [p for m in result.all_messages() for p in m.parts if p.part_kind == "tool-call"]
    expect_model(bool(called), f"the model answered without calling the tool: {result.output!r}")
    check(bool(result.output), "no answer")
    return f"{len(called)} call(s); {result.output}"


# the agent's loop gives up when the model keeps calling tools, or never answers in the form asked
finish(run("pydantic-ai-slim", {"chat": chat, "stream": stream, "structured": structured, "tool": tool},
           model_choices=(UsageLimitExceeded, UnexpectedModelBehavior)))
