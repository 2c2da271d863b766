"""llama-index's quick-start on `OpenAILike` (a function-calling chat model): chat, stream_chat,
`structured_predict` in its default program mode (a forced function call), and a FunctionTool called and
answered from."""

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
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

args = arguments()
llm = OpenAILike(model=args.model, api_base=args.base_url, api_key=args.api_key, temperature=0, max_tokens=MAX_TOKENS,
                 max_retries=0, timeout=300, is_chat_model=True, is_function_calling_model=True, context_window=32768)
ask = [ChatMessage(role="user", content=QUESTION)]
weather = FunctionTool.from_defaults(fn=get_weather)


def chat() -> str:
    text = llm.chat(ask).message.content
    check(bool(text), "empty answer")
    return text


def stream() -> str:
    text = "".join(chunk.delta or "" for chunk in llm.stream_chat(ask))
    check(text == chat(), "the stream's text differs from the answer's")
    return text


def structured() -> str:
    city = llm.structured_predict(City, PromptTemplate("{question}"), question=STRUCTURED)
    check(isinstance(city, City), f"not a City: {city!r}")
    return city.model_dump_json()


def tool() -> str:
    first = llm.chat_with_tools([weather], user_msg=TOOL_QUESTION, tool_required=True)
    calls = llm.get_tool_calls_from_response(first, error_on_no_tool_call=False)
    check(len(calls) >= 1 and calls[0].tool_name == "get_weather", f"no call: {first.message}")
    result = weather.call(**calls[0].tool_kwargs)
    messages = [ChatMessage(role="user", content=TOOL_QUESTION), first.message,
                ChatMessage(role="tool", content=str(result), additional_kwargs={"tool_call_id": calls[0].tool_id})]
    final = llm.chat_with_tools([weather], chat_history=messages)
    again = llm.get_tool_calls_from_response(final, error_on_no_tool_call=False)
    expect_model(not again and bool(final.message.content), f"after the tool's result the model went on: {final}")
    return final.message.content


finish(run("llama-index-llms-openai-like", {"chat": chat, "stream": stream, "structured": structured, "tool": tool}))
