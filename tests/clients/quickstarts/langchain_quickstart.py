"""langchain-openai's quick-start: `ChatOpenAI` invoke and stream, `with_structured_output` in its default
method, a bound tool (forced, then its result sent back), and `use_responses_api=True`."""

from __future__ import annotations

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
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool as as_tool
from langchain_openai import ChatOpenAI

args = arguments()
common = {"model": args.model, "base_url": args.base_url, "api_key": args.api_key, "temperature": 0,
          "max_retries": 0, "timeout": 300}
llm = ChatOpenAI(max_tokens=MAX_TOKENS, **common)
weather = as_tool(get_weather)


def chat() -> str:
    text = llm.invoke(QUESTION).content
    check(bool(text), "empty answer")
    return text


def stream() -> str:
    text = "".join(chunk.content for chunk in llm.stream(QUESTION))
    check(text == chat(), "the stream's text differs from the answer's")
    return text


def structured() -> str:
    city = ChatOpenAI(max_tokens=64, **common).with_structured_output(City).invoke(STRUCTURED)
    check(isinstance(city, City), f"not a City: {city!r}")
    return city.model_dump_json()


def tool() -> str:
    messages = [HumanMessage(TOOL_QUESTION)]
    first = llm.bind_tools([weather], tool_choice="get_weather").invoke(messages)
    check(len(first.tool_calls) >= 1 and first.tool_calls[0]["name"] == "get_weather", f"no call: {first}")
    call = first.tool_calls[0]
    messages += [first, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([weather]).invoke(messages)
    expect_model(not final.tool_calls and bool(final.content), f"after the tool's result the model went on: {final}")
    return final.content


def responses() -> str:
    answer = ChatOpenAI(max_tokens=MAX_TOKENS, use_responses_api=True, **common).invoke(QUESTION)
    check(bool(answer.text), f"no text: {answer}")
    return answer.text


finish(run("langchain-openai", {"chat": chat, "stream": stream, "structured": structured, "tool": tool,
                                "responses": responses}))
