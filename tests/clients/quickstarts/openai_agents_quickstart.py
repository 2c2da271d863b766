"""openai-agents' quick-start on its default model (the Responses API): an Agent's answer, its streamed run,
a Pydantic `output_type`, and one function tool."""

from __future__ import annotations

import asyncio

import openai
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from harness import MAX_TOKENS, QUESTION, STRUCTURED, TOOL_QUESTION, City, arguments, check, finish, get_weather, run

args = arguments()
set_tracing_disabled(True)  # traces would go to OpenAI's servers
settings = ModelSettings(temperature=0, max_tokens=MAX_TOKENS)
called: list[str] = []


def fresh_client() -> None:
    """A client per step: each step runs its own event loop, and an async client's connections belong to one."""
    set_default_openai_client(openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0,
                                                 timeout=300), use_for_tracing=False)


@function_tool
def weather(city: str) -> str:
    """Get the current weather in a city."""
    called.append(city)
    return get_weather(city)


def chat() -> str:
    fresh_client()
    text = Runner.run_sync(Agent(name="colors", model=args.model, model_settings=settings), QUESTION).final_output
    check(bool(text), "empty answer")
    return text


def stream() -> str:
    fresh_client()
    async def streamed() -> str:
        result = Runner.run_streamed(Agent(name="colors", model=args.model, model_settings=settings), QUESTION)
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        check("".join(deltas) == result.final_output, "the deltas differ from the final output")
        return result.final_output

    text = asyncio.run(streamed())
    check(text == chat(), "the stream's text differs from the answer's")
    return text


def structured() -> str:
    fresh_client()
    agent = Agent(name="cities", model=args.model, output_type=City,
                  model_settings=ModelSettings(temperature=0, max_tokens=64))
    city = Runner.run_sync(agent, STRUCTURED).final_output
    check(isinstance(city, City), f"not a City: {city!r}")
    return city.model_dump_json()


def tool() -> str:
    fresh_client()
    agent = Agent(name="weather", model=args.model, tools=[weather],
                  model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS, tool_choice="required",
                                               parallel_tool_calls=False), reset_tool_choice=True)
    output = Runner.run_sync(agent, TOOL_QUESTION, max_turns=3).final_output
    check(bool(called) and all(called), f"the tool was called with {called}")
    return f"{called}: {output}"


# the run gives up when the model keeps calling the tool, or answers with output the agent cannot read
finish(run("openai-agents", {"chat": chat, "stream": stream, "structured": structured, "tool": tool},
           model_choices=(MaxTurnsExceeded, ModelBehaviorError)))
