"""OpenAI response shapes the gateway builds itself: a whole answer assembled from a live stream (to cache
it), and a cached answer replayed as a stream in the same format a live one has."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from llmserve.server.sse import SSE_DONE


class StreamAssembler:
    """Collects a chat or completions stream's events into the non-streaming answer they add up to.

    `result()` is None where the stream cannot be replayed faithfully from a plain answer: it did not end
    with every choice finished by a stop or its length, it carried an error event, or it carried tool calls or
    logprobs (those pass through, uncached).
    """

    def __init__(self, route: str) -> None:
        self.route = route
        self.head: dict[str, Any] | None = None
        self.texts: dict[int, list[str]] = {}
        self.finish: dict[int, str | None] = {}
        self.usage: dict[str, Any] | None = None
        self.replayable = True

    def feed(self, event: dict[str, Any]) -> None:
        if "error" in event:  # a failure in-band: never an answer to serve again
            self.replayable = False
            return
        if self.head is None:
            self.head = {k: event.get(k) for k in ("id", "created", "model", "system_fingerprint") if k in event}
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            index = choice.get("index", 0)
            parts = self.texts.setdefault(index, [])
            self.finish.setdefault(index, None)
            if choice.get("logprobs"):
                self.replayable = False
            if self.route == "chat":
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.replayable = False
                if delta.get("content"):
                    parts.append(delta["content"])
            elif choice.get("text"):
                parts.append(choice["text"])
            if choice.get("finish_reason"):
                self.finish[index] = choice["finish_reason"]

    def result(self) -> dict[str, Any] | None:
        if not self.replayable or self.head is None or not self.texts or None in self.finish.values():
            return None
        choices = []
        for index in sorted(self.texts):
            text = "".join(self.texts[index])
            body: dict[str, Any] = {"message": {"role": "assistant", "content": text}} if self.route == "chat" \
                else {"text": text}
            choices.append({"index": index, **body, "logprobs": None, "finish_reason": self.finish[index]})
        obj = "chat.completion" if self.route == "chat" else "text_completion"
        return {**self.head, "object": obj, "choices": choices, "usage": self.usage}


CACHEABLE_FINISH = ("stop", "length")  # not "error", a tool call or an unfinished choice


def replayable(route: str, answer: dict[str, Any]) -> bool:
    """A non-streamed answer that `replay_events` can turn into the stream a live request would have given, and
    that ended as an answer (every choice stopped or reached its length); embeddings whenever they hold vectors."""
    if route == "embeddings":
        return bool(answer.get("data"))
    for choice in answer.get("choices") or ():
        if choice.get("finish_reason") not in CACHEABLE_FINISH or choice.get("logprobs"):
            return False
        message = choice.get("message") or {}
        if route == "chat" and (message.get("tool_calls") or message.get("function_call")):
            return False
    return bool(answer.get("choices"))


def fresh_identity(route: str, answer: dict[str, Any]) -> None:
    """A replayed answer is a new response: its own id (in the format of the route's) and `created` (embeddings
    have neither)."""
    if route == "embeddings":
        return
    answer["id"] = f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    answer["created"] = int(time.time())


def replay_events(route: str, answer: dict[str, Any], include_usage: bool, model: str) -> list[bytes]:
    """The SSE events of a cached answer: per choice a role chunk (chat), its text, a finish chunk; then the
    usage chunk if asked; then [DONE]. The id and `created` as the answer has them (`fresh_identity`)."""
    head = {"id": answer.get("id"), "object": "chat.completion.chunk" if route == "chat" else "text_completion",
            "created": answer.get("created", int(time.time())), "model": model}
    usage_field = {"usage": None} if include_usage else {}
    events = []

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({**head, "choices": choices, **usage_field, **extra}) + b"\n\n"

    for choice in answer["choices"]:
        index = choice.get("index", 0)
        if route == "chat":
            text = (choice.get("message") or {}).get("content") or ""
            events.append(event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]))
            if text:
                events.append(event([{"index": index, "delta": {"content": text}, "logprobs": None,
                                      "finish_reason": None}]))
            events.append(event([{"index": index, "delta": {}, "logprobs": None,
                                  "finish_reason": choice.get("finish_reason")}]))
        else:
            text = choice.get("text") or ""
            if text:
                events.append(event([{"index": index, "text": text, "logprobs": None, "finish_reason": None}]))
            events.append(event([{"index": index, "text": "", "logprobs": None,
                                  "finish_reason": choice.get("finish_reason")}]))
    if include_usage:
        events.append(event([], usage=answer.get("usage")))
    events.append(SSE_DONE)
    return events
