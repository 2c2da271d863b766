"""Which text of a request is context that compression may shorten, which is the question it must not touch, and
which requests it must refuse.

The question is the end of the last user message: its last paragraph, extended back over at most two more
while it is only a cue ("Answer:") or short without a '?' or an instruction (so "Question: …?\\n\\nAnswer:"
stays whole). Long-context prompts put the ask after the material (LongBench, RAG templates, a pasted document
then "summarise this"); a message of one paragraph is all question. Everything before it (system prompts and
their documents, earlier turns, the pasted material) is context. Tool results and non-text parts are left as
they are: they are data. Of the context, only what the policy names is compressed: by default the documents (the
material before the question) and earlier turns; system and developer messages, the operator's instructions, only
when the policy names `system`.

Refused, sent unchanged with a reason: code the user asks to edit (the model must see every token of it, and
the prose around it carries the requirements), JSON (one dropped token and it no longer parses), and a request
with nothing before its question.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from llmserve.gateway.compression.protect import FENCE, code_lines, instruction_spans

_ROLE_CONTEXT = {"system": "system", "developer": "system", "user": "turns", "assistant": "turns"}
DEFAULT_CONTEXT = ("documents", "turns")
_PARAGRAPH = re.compile(r"\n[ \t]*\n")
_EDIT = re.compile(r"\b(?:fix|edit|change|modify|refactor|rewrite|update|improve|optimi[sz]e|debug|rename|add|remove|"
                   r"delete|implement|complete|convert|port|patch|correct|clean up|extend|migrate|replace|simplify)\b",
                   re.I)
_SHORT_TAIL = 200  # characters: a last paragraph this short, without '?' or an instruction, is not the whole ask


@dataclass(frozen=True)
class Part:
    """A span of one message's content (or of the prompt) that compression may shorten."""

    message: int | None  # index in `messages`; None: the completion's prompt
    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Refusal:
    code: str  # a metric label: short, no_context, code_edit, structured, not_text, disabled, no_scorer, scorer_error
    detail: str

    def __str__(self) -> str:
        return f"{self.code} ({self.detail})"


@dataclass(frozen=True)
class Prompt:
    parts: tuple[Part, ...]
    question: str


def split(route: str, body: dict[str, Any], context: tuple[str, ...] = DEFAULT_CONTEXT) -> Prompt | Refusal:
    """The request's compressible context (the kinds `context` names) and its question, or why it must not be
    compressed."""
    if route == "chat":
        found = _split_chat(body.get("messages"), context)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return Refusal("not_text", "the prompt is not one string")
        start = question_start(prompt) if "documents" in context else 0
        found = ((Part(None, 0, start, prompt[:start]),) if start else ()), prompt[start:], [prompt]
    if isinstance(found, Refusal):
        return found
    parts, question, texts = found
    if _EDIT.search(question) and any(holds_code(t) for t in texts):
        return Refusal("code_edit", "the request asks to edit code it holds")
    for part in parts:
        if _is_json(part.text):
            where = "the prompt" if part.message is None else f"message {part.message}"
            return Refusal("structured", f"{where} is JSON")
    if not any(p.text.strip() for p in parts):
        return Refusal("no_context", f"nothing of {' or '.join(context)} before the question to compress")
    return Prompt(parts, question)


def question_start(text: str) -> int:
    """Where the question begins in the last user message (0: all of it)."""
    breaks = [m.end() for m in _PARAGRAPH.finditer(text.rstrip())]
    if not breaks:
        return 0
    start = breaks.pop()
    for _ in range(2):
        tail = text[start:].strip()
        # "Answer:", "Summary:": what follows the ask, not the ask
        cue = tail.endswith(":") and len(tail) < 40 and "\n" not in tail
        if not breaks or not cue and ("?" in tail or len(tail) >= _SHORT_TAIL or instruction_spans(tail)):
            break
        start = breaks.pop()
    return start


def holds_code(text: str) -> bool:
    """A fenced block, or three lines or more that read as code."""
    return FENCE.search(text) is not None or len(code_lines(text)) >= 3


def replace(body: dict[str, Any], parts: tuple[Part, ...], texts: list[str]) -> dict[str, Any]:
    """A copy of `body` with each part's span replaced by its new text (the caller's body is left as it was)."""
    body = dict(body)
    if any(p.message is not None for p in parts):
        body["messages"] = list(body["messages"])
    for part, text in zip(parts, texts, strict=True):
        if part.message is None:
            body["prompt"] = text + body["prompt"][part.end:]
        else:
            message = dict(body["messages"][part.message])
            content = message["content"]
            message["content"] = content[:part.start] + text + content[part.end:]
            body["messages"][part.message] = message
    return body


def _split_chat(messages: Any, context: tuple[str, ...]) -> tuple[tuple[Part, ...], str, list[str]] | Refusal:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return Refusal("not_text", "messages is not a list of objects")
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return Refusal("no_context", "no user message")
    last = users[-1]
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    parts = [Part(i, 0, len(m["content"]), m["content"]) for i, m in enumerate(messages[:last])
             if _ROLE_CONTEXT.get(m.get("role")) in context and isinstance(m.get("content"), str) and m["content"]]
    content = messages[last].get("content")
    if not isinstance(content, str):
        return tuple(parts), _text_of(content), texts
    start = question_start(content) if "documents" in context else 0
    if start:
        parts.append(Part(last, 0, start, content[:start]))
    return tuple(parts), content[start:], texts


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _is_json(text: str) -> bool:
    text = text.strip()
    if not text.startswith(("{", "[")):
        return False
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True
