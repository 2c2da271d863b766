"""Tool calling in the Hermes format that Qwen2.5's chat template asks for, on any chat model.

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. Templates that
render tools themselves (Qwen2.5's) get the tools and the conversation's earlier calls and results as they
expect them (arguments as objects, not JSON text); for a template that knows nothing of tools, the same
instructions go into the system message and earlier calls and results are written as text, so tool calling
works on every chat model, as well as that model follows the instructions.

`tool_choice` "required" or a named function is enforced by constrained decoding: a grammar of tool calls
whose JSON follows each function's parameter schema. "auto" leaves the model free and parses what it writes,
unless a JSON `response_format` is asked for too: then the model may call tools or answer in that format, as
OpenAI's API lets it (a forced call takes precedence over the format, which applies to a later answer). "none"
renders no tools at all.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.errors import APIError
from llmserve.server.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, Tool, ToolCall
from llmserve.server.serving_engine import response_format_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def active_tools(request: ChatCompletionRequest) -> list[Tool]:
    """The tools the model is offered: none where tool_choice is "none"; a named choice must name one."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice == "none":
        return []
    if choice is not None and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice is not None and not isinstance(choice, str):
        if not any(t.function.name == choice.function.name for t in tools):
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                           "tools", param="tool_choice")
    return tools


def chat_messages(messages: list[ChatMessage], texts: list[str], tools: list[Tool], template_has_tools: bool
                  ) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it (`texts`: each message's content as text)."""
    out: list[dict[str, Any]] = []
    for m, text in zip(messages, texts, strict=True):
        role = "system" if m.role == "developer" else m.role  # templates predate the 'developer' role
        calls = m.tool_calls or []
        if template_has_tools:
            message: dict[str, Any] = {"role": role, "content": text}
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}} for c in calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            parts = [text] if text else []
            parts += [f"{OPEN}\n{json.dumps({'name': c.function.name, 'arguments': _arguments_object(c.function.arguments)}, ensure_ascii=False)}\n{CLOSE}"  # noqa: E501
                      for c in calls]
            out.append({"role": role, "content": "\n".join(parts)})
    if tools and not template_has_tools:
        instructions = _INSTRUCTIONS.format(tools="\n".join(json.dumps(t.model_dump(exclude_none=True),
                                                                       ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def tool_call_constraint(request: ChatCompletionRequest, tools: list[Tool]) -> StructuredOutputsParams | None:
    """For tool_choice "required" or a named function: a grammar of tool calls (one, or several with
    parallel_tool_calls) whose JSON holds a function's name and arguments that follow its parameter schema. For
    "auto" beside a JSON response_format: those calls, or an answer in the format."""
    choice = request.tool_choice
    if not tools or choice == "none":
        return None
    if choice in (None, "auto"):
        answer = response_format_schema(request)
        if answer is None:
            return None
        return StructuredOutputsParams(grammar=f"start: call{_repeat(request)} | %json {json.dumps(answer)}\n"
                                               f"{_call_rule(tools)}")
    if choice == "required":
        return StructuredOutputsParams(grammar=f"start: call{_repeat(request)}\n{_call_rule(tools)}")
    named = [t for t in tools if t.function.name == choice.function.name]
    return StructuredOutputsParams(grammar=f"start: call\n{_call_rule(named)}")


def _repeat(request: ChatCompletionRequest) -> str:
    """More calls may follow the first unless parallel_tool_calls is false."""
    return ' ("\\n" call)*' if request.parallel_tool_calls else ""


def _call_rule(tools: list[Tool]) -> str:
    """The Lark rules of one call in the Hermes format: the tag, the function's name, then arguments that follow
    its parameter schema. Each schema is the root of its own %json, so its `$ref`s to `#/$defs/...` (what
    Pydantic writes for a nested model) resolve as the client meant them."""
    names = [f"call_{i}" for i in range(len(tools))]
    rules = [f'call: "{OPEN}\\n" ({" | ".join(names)}) "}}\\n{CLOSE}"']
    for name, tool in zip(names, tools, strict=True):
        head = json.dumps(f'{{"name": {json.dumps(tool.function.name)}, "arguments": ')
        rules.append(f"{name}: {head} %json {json.dumps(tool.function.parameters or {'type': 'object'})}")
    return "\n".join(rules) + "\n"


class ToolCallParser:
    """Splits a model's output into plain content and tool calls, whole (`parse`) or as it streams (`feed`, then
    `finish`): text that may be the start of a call is held back until it is known not to be.

    Besides tagged calls, an output that is nothing but calls' JSON (objects or lists of them, one after another,
    each naming one of the offered functions) is calls: small models (Qwen2.5-Coder-0.5B among them) often leave
    the tags out.
    An output that begins with `{` or `[` is therefore held until it ends.

    A call's arguments are the model's own JSON text (not re-serialised), so a call streamed in pieces
    (`in_progress`) and the same call whole are the same string."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._held = ""
        self._in_call = False
        self._bare: bool | None = None  # None: undecided (only whitespace so far); True: holding a bare call
        self._call_id: str | None = None  # the id of the call being written, once `in_progress` named it
        self.num_calls = 0

    def in_progress(self) -> tuple[str, str, str] | None:
        """(id, name, its arguments' text so far) of the tagged call being written, once its name is whole and
        its arguments object has begun; None otherwise. Whole, the call has the same id and arguments that begin
        with this text: a grammar-enforced call can stream its arguments in pieces, as OpenAI's API does."""
        if not self._in_call:
            return None
        head = _CALL_HEAD.match(self._held)
        if head is None or not self._held[head.end():].startswith("{"):
            return None
        end, _ = _json_value_end(self._held, head.end())
        self._call_id = self._call_id or _new_call_id()
        return self._call_id, json.loads(f'"{head.group(1)}"'), self._held[head.end(): end]

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content that can go out now, and the calls this text completed."""
        if self._bare is not False:
            self._held += text
            start = self._held.lstrip()[:1]
            if not start or start in "{[":
                self._bare = True if start else None
                return "", []
            self._bare, text, self._held = False, self._held, ""
        self._held += text
        content, calls = "", []
        while True:
            if not self._in_call:
                at = self._held.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._held, OPEN)
                    content += self._held[: len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    break
                content += self._held[:at]
                self._held, self._in_call = self._held[at + len(OPEN):], True
            else:
                at = self._held.find(CLOSE)
                if at < 0:
                    break
                raw, self._held, self._in_call = self._held[:at], self._held[at + len(CLOSE):], False
                call = self._call(raw)
                if call is None:
                    content += OPEN + raw + CLOSE  # not a call after all: the model's text, as written
                else:
                    calls.append(call)
        return self._content(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: what was held (a call whose closing tag never came counts when its
        JSON is whole)."""
        if self._bare:
            held, self._held, self._bare = self._held, "", False
            calls = self._bare_calls(held)
            if calls:
                return "", calls
            content, calls = self.feed(held)  # not a bare call: tags may still follow the JSON
            rest, more = self.finish()
            return content + rest, calls + more
        held, self._held = self._held, ""
        if not self._in_call:
            return self._content(held), []
        self._in_call = False
        call = self._call(held)
        return (self._content(OPEN + held), []) if call is None else ("", [call])

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: its content (None when it held only calls) and its calls."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        content, calls = content + rest, calls + more
        return ((content.strip() or None) if calls else content), calls

    def _content(self, text: str) -> str:
        return text if not self.num_calls or text.strip() else ""  # whitespace between calls is not content

    def _bare_calls(self, text: str) -> list[ToolCall]:
        """Calls from JSON values one after another (an object or a list each): a model that leaves the tags out
        writes several calls as one per line."""
        objs: list[Any] = []
        decoder, at = json.JSONDecoder(), 0
        while (at := _skip_space(text, at)) < len(text):
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return []
            objs += obj if isinstance(obj, list) else [obj]
        if not objs or not all(isinstance(o, dict) and o.get("name") in self.names for o in objs):
            return []
        return [call for o in objs if (call := self._call(json.dumps(o))) is not None]

    def _call(self, raw: str) -> ToolCall | None:
        call_id, self._call_id = self._call_id or _new_call_id(), None  # the next call gets its own
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = _raw_arguments(raw, arguments) or json.dumps(arguments, ensure_ascii=False)
        self.num_calls += 1
        return ToolCall(id=call_id, function=FunctionCall(name=obj["name"], arguments=arguments))


# A Hermes call's JSON as the models (and our grammar) write it: the name first, then the arguments.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _skip_space(text: str, at: int) -> int:
    return len(text) - len(text[at:].lstrip())


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _json_value_end(text: str, start: int) -> tuple[int, bool]:
    """Where the JSON object or array that begins at `start` ends (past its closing bracket), and whether it
    did end within `text` (else: `len(text)`)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
    return len(text), False


def _raw_arguments(raw: str, parsed: Any) -> str | None:
    """The arguments' own text in a call's JSON, where the call names its function first (None elsewhere)."""
    head = _CALL_HEAD.match(raw)
    if head is None or not raw[head.end():].startswith(("{", "[")):
        return None
    end, closed = _json_value_end(raw, head.end())
    text = raw[head.end(): end]
    try:
        return text if closed and json.loads(text) == parsed else None
    except ValueError:
        return None


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as the templates render them: the object its JSON text holds (the text itself
    where it holds none)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (and may become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
