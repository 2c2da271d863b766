from __future__ import annotations

import orjson

from llmserve.gateway.responses import StreamAssembler, fresh_identity, replay_events, replayable


def events(raw: list[bytes]) -> list[dict]:
    return [orjson.loads(e[6:]) for e in raw if e.startswith(b"data: {")]


def test_replay_then_assemble_round_trips_chat_and_completions():
    chat = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m", "usage": {"total_tokens": 9},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there"}, "logprobs": None,
                         "finish_reason": "stop"},
                        {"index": 1, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": "length"}]}
    completion = {"id": "t1", "object": "text_completion", "created": 1, "model": "m", "usage": None,
                  "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "stop"}]}
    for route, answer in (("chat", chat), ("completions", completion)):
        raw = replay_events(route, answer, include_usage=True, model="m")
        assert raw[-1] == b"data: [DONE]\n\n"
        assembler = StreamAssembler(route)
        for event in events(raw):
            assembler.feed(event)
        rebuilt = assembler.result()
        assert rebuilt["choices"] == answer["choices"] and rebuilt["usage"] == answer["usage"]
        assert rebuilt["id"] == answer["id"] and rebuilt["object"] == answer["object"]


def test_usage_chunk_only_when_asked():
    answer = {"id": "c", "model": "m", "usage": {"total_tokens": 3},
              "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]}
    assert all("usage" not in e for e in events(replay_events("chat", answer, False, "m")))
    last = events(replay_events("chat", answer, True, "m"))[-1]
    assert last["choices"] == [] and last["usage"] == {"total_tokens": 3}


def test_unfinished_or_tool_call_streams_are_not_cached():
    assembler = StreamAssembler("chat")
    assembler.feed({"id": "c", "choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": None}]})
    assert assembler.result() is None  # no finish_reason yet
    assembler.feed({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assembler.feed({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    assert assembler.result() is None
    assert not replayable("chat", {"choices": [{"message": {"tool_calls": [{}]}, "finish_reason": "tool_calls"}]})
    assert not replayable("completions", {"choices": [{"text": "a", "logprobs": {"tokens": ["a"]}}]})


def test_answers_that_ended_in_an_error_are_not_cached():
    assert not replayable("chat", {"choices": [{"message": {"content": "<tool_call>"}, "finish_reason": "error"}]})
    assembler = StreamAssembler("chat")
    assembler.feed({"id": "c", "choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]})
    assembler.feed({"error": {"message": "the output constraint failed while decoding", "code": "constraint_failed"}})
    assembler.feed({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert assembler.result() is None


def test_a_replay_is_a_response_of_its_own():
    answer = {"id": "chatcmpl-cached", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]}
    fresh_identity("chat", answer)
    assert answer["id"].startswith("chatcmpl-") and answer["id"] != "chatcmpl-cached" and answer["created"] > 1
    assert {e["id"] for e in events(replay_events("chat", answer, False, "m"))} == {answer["id"]}
