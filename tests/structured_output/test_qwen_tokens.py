"""Constraints on the tokenizer they exist for: Qwen2.5's `<tool_call>` and `</tool_call>` are single added tokens
that its tokenizer reads as text (special=False), while `<|im_end|>` is special. A grammar that writes the tag as
text must take the tag's token (the model writes it so) and go on; a special token's name in a constraint is text,
and the special token itself never enters a JSON string."""

from __future__ import annotations

import numpy as np
import pytest

from llmserve.loader import load_tokenizer
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.protocol import ChatCompletionRequest
from llmserve.server.tool_calls import active_tools, tool_call_constraint
from llmserve.structured_output import StructuredOutputManager
from tests.model_files import QWEN, needs_qwen_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN_VOCAB, IM_END, ENDOFTEXT, TOOL_CALL = 151936, 151645, 151643, 151657


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(QWEN)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, QWEN_VOCAB, [IM_END, ENDOFTEXT])


def _allowed(manager: StructuredOutputManager, matcher) -> set[int]:
    mask = manager.bitmasks([("r", matcher, [])])["r"]
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:QWEN_VOCAB]).tolist())


def _follows(manager: StructuredOutputManager, spec: StructuredOutputsParams, tokens: list[int]) -> bool:
    """Whether a fresh matcher takes `tokens` one by one, each allowed by its mask first, and ends complete."""
    matcher = manager.new_matcher(spec)
    for token in tokens:
        if token not in _allowed(manager, matcher) or not matcher.consume_token(token) or matcher.is_error():
            return False
    return matcher.is_accepting()


@needs_qwen_tokenizer
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_takes_the_tag_tokens_qwen_writes(tokenizer, manager, tool_choice):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                                    tool_choice=tool_choice)
    spec = tool_call_constraint(request, active_tools(request))
    tokens = tokenizer.encode(CALL, add_special_tokens=False)
    assert tokens[0] == TOOL_CALL and tokens[-1] == TOOL_CALL + 1  # the tags are one token each
    manager.compile(spec)
    assert _allowed(manager, manager.new_matcher(spec)) == {TOOL_CALL}  # the call's tag, as Qwen writes it
    assert _follows(manager, spec, tokens)
    assert tokenizer.decode(tokens, skip_special_tokens=True) == CALL  # and the parser sees the tags in the text


@needs_qwen_tokenizer
def test_a_forced_call_whose_schema_refers_to_its_own_defs(tokenizer, manager):
    """Pydantic writes a nested model as `$defs` and a `$ref` from the root (instructor's list of a type is
    such a function): the reference resolves from the function's parameters, not from a wrapper around them."""
    cities = {"type": "function", "function": {"name": "IterableCity", "parameters": {
        "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
        "type": "object", "properties": {"tasks": {"type": "array", "items": {"$ref": "#/$defs/City"}}},
        "required": ["tasks"]}}}
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Two cities?"}], tools=[cities],
                                    tool_choice="required")
    spec = tool_call_constraint(request, active_tools(request))
    manager.compile(spec)
    call = '<tool_call>\n{"name": "IterableCity", "arguments": {"tasks": [{"name": "Rome"}, {"name": "Milan"}]}}' \
           '\n</tool_call>'
    assert _follows(manager, spec, tokenizer.encode(call, add_special_tokens=False))
    wrong = call.replace('{"name": "Rome"}', '{"town": "Rome"}')  # not a City: the grammar refuses it
    assert not _follows(manager, spec, tokenizer.encode(wrong, add_special_tokens=False))


@needs_qwen_tokenizer
def test_a_regex_with_the_tag_as_text_takes_the_tag_token(tokenizer, manager):
    spec = StructuredOutputsParams(regex="<tool_call>[a-z]+")
    assert _follows(manager, spec, tokenizer.encode("<tool_call>weather", add_special_tokens=False))
    assert _follows(manager, spec, tokenizer.encode("<", add_special_tokens=False)
                    + tokenizer.encode("tool_call>abc", add_special_tokens=False))  # spelled out, too


@needs_qwen_tokenizer
def test_special_tokens_stay_special(tokenizer, manager):
    string = StructuredOutputsParams(json={"type": "string"})
    matcher = manager.new_matcher(string)
    assert matcher.consume_token(tokenizer.encode('"', add_special_tokens=False)[0])
    assert IM_END not in _allowed(manager, matcher)  # inside a JSON string, never the end of the turn
    named = StructuredOutputsParams(regex=r"<\|im_end\|>x")  # a special token's name is text here
    assert IM_END not in _allowed(manager, manager.new_matcher(named))
    spelled = tokenizer.backend_tokenizer.encode("<|im_end|>x", add_special_tokens=False).ids
    assert IM_END in spelled  # the tokenizer reads the name as the special token ...
    assert _follows(manager, named, [t for piece in ("<|", "im", "_end", "|>", "x")
                                     for t in tokenizer.encode(piece, add_special_tokens=False)])  # ... the grammar not
