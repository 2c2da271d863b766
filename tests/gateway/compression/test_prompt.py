"""Which text is context, which is the question, and which requests are refused."""

from llmserve.gateway.compression.prompt import Prompt, Refusal, question_start, replace, split

DOC = "Background paragraph one about the town.\n\nBackground paragraph two about the river."


def test_the_question_is_the_last_paragraph_of_the_last_user_message():
    body = {"messages": [{"role": "system", "content": "You are helpful. " + DOC},
                         {"role": "user", "content": "Earlier turn."},
                         {"role": "assistant", "content": "Earlier answer."},
                         {"role": "tool", "content": "{\"result\": 1}"},
                         {"role": "user", "content": DOC + "\n\nWhere is the river?"}]}
    found = split("chat", body)
    assert isinstance(found, Prompt)
    assert found.question == "Where is the river?"
    assert [p.message for p in found.parts] == [1, 2, 4]  # the system prompt is instructions, the tool result data
    assert found.parts[-1].text == DOC + "\n\n"
    assert [p.message for p in split("chat", body, ("turns",)).parts] == [1, 2]  # only what the policy names
    assert [p.message for p in split("chat", body, ("documents",)).parts] == [4]
    found = split("chat", body, ("documents", "turns", "system"))
    assert [p.message for p in found.parts] == [0, 1, 2, 4]
    new = replace(body, found.parts, ["S", "U", "A", "C"])
    assert [m["content"] for m in new["messages"]] == ["S", "U", "A", "{\"result\": 1}", "CWhere is the river?"]
    assert body["messages"][0]["content"].startswith("You are helpful.")  # the caller's body is untouched


def test_a_short_cue_after_the_question_stays_with_it():
    text = DOC + "\n\nQuestion: where is the river?\n\nAnswer:"
    assert text[question_start(text):] == "Question: where is the river?\n\nAnswer:"
    assert question_start("One paragraph only, all of it the ask.") == 0


def test_completions_prompts_split_the_same_way():
    found = split("completions", {"prompt": DOC + "\n\nSummarise."})
    assert isinstance(found, Prompt) and found.question == "Summarise." and found.parts[0].message is None
    assert replace({"prompt": DOC + "\n\nSummarise."}, found.parts, ["short "])["prompt"] == "short Summarise."
    assert split("completions", {"prompt": ["a", "b"]}) == Refusal("not_text", "the prompt is not one string")


def test_code_the_user_asks_to_edit_is_refused():
    code = "```python\ndef area(r):\n    return 3.14 * r * r\n```"
    refusal = split("chat", {"messages": [{"role": "user", "content": DOC + "\n\n" + code + "\n\nFix the bug."}]})
    assert isinstance(refusal, Refusal) and refusal.code == "code_edit"
    lines = "x = 1\ny = compute(x);\nreturn y;"
    assert split("chat", {"messages": [{"role": "system", "content": lines},
                                       {"role": "user", "content": "Refactor this."}]}).code == "code_edit"
    # code that is only read: compressed around (its lines are protected spans)
    assert isinstance(split("chat", {"messages": [{"role": "user", "content": DOC + "\n\n" + code
                                                   + "\n\nWhat does it compute?"}]}), Prompt)


def test_json_context_and_a_lone_question_are_refused():
    refusal = split("chat", {"messages": [{"role": "user", "content": '{"users": [{"id": 1}]}'},
                                          {"role": "user", "content": "How many users?"}]})
    assert refusal == Refusal("structured", "message 0 is JSON")
    assert split("chat", {"messages": [{"role": "system", "content": DOC},  # instructions are not context
                                       {"role": "user", "content": "Where is the river?"}]}).code == "no_context"
    assert split("chat", {"messages": [{"role": "user", "content": "Just a question?"}]}).code == "no_context"
    assert split("chat", {"messages": [{"role": "assistant", "content": "hi"}]}).code == "no_context"
