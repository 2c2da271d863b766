"""`llmserve eval`: perplexity against a direct transformers computation, the HumanEval sandbox on known
completions (right, wrong, endless, greedy for memory), agreement's metrics, and the CLI end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

from llmserve.evaluate.agreement import agreement, sentence_cosines
from llmserve.evaluate.datasets import humaneval_problems, perplexity_text
from llmserve.evaluate.humaneval import SandboxLimits, run_completion
from llmserve.evaluate.perplexity import perplexity, windows
from llmserve.evaluate.targets import Completion, OfflineTarget


def test_windows_score_every_token_once():
    spans = windows(list(range(100)), 32, 16)
    scored = [t for b, e, first in spans for t in range(first, e)]
    assert scored == list(range(1, 100))
    assert all(e - b <= 32 for b, e, _ in spans) and spans[1][2] - spans[1][0] == 16  # context before the stride


def test_perplexity_equals_transformers_computing_it_directly(llm_fp32, hf_model):
    ids = llm_fp32.get_tokenizer().encode(perplexity_text()[:1500], add_special_tokens=False)[:200]
    ours = perplexity(OfflineTarget(llm_fp32), ids, window=64, stride=32)
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, first in windows(ids, 64, 32):
            logits = hf_model(torch.tensor([ids[begin:end]])).logits[0].float()
            logprobs = torch.log_softmax(logits, -1)
            for pos in range(first, end):
                nll -= logprobs[pos - begin - 1, ids[pos]].item()
                count += 1
    assert ours.tokens == count == len(ids) - 1
    assert ours.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert 2 < ours.perplexity < 200  # real English text, a real small model


PROBLEMS = {p["task_id"]: p for p in humaneval_problems()[:3]}
FAST = SandboxLimits(timeout_s=3.0, memory_mb=512)


@pytest.mark.parametrize("task_id", list(PROBLEMS))
def test_the_canonical_solution_passes_and_a_wrong_one_fails(task_id):
    problem = PROBLEMS[task_id]
    assert run_completion(problem, problem["canonical_solution"], FAST).passed
    wrong = run_completion(problem, "    return None\n", FAST)
    assert not wrong.passed and wrong.reason.startswith("failed")


@pytest.mark.parametrize(("completion", "why"), [
    ("    while True:\n        pass\n", "timeout"),
    ("    x = [0] * (10 ** 10)\n", "MemoryError"),
    ("    import os\n    while True:\n        os.fork()\n", ""),
    ("    open('big', 'w').write('x' * (64 << 20))\n", ""),
])
def test_a_runaway_completion_fails_alone_and_in_bounded_time(completion, why):
    problem = PROBLEMS["HumanEval/0"]
    start = time.monotonic()
    result = run_completion(problem, completion, FAST)
    assert not result.passed and why in result.reason
    assert time.monotonic() - start < FAST.timeout_s + 5
    assert run_completion(problem, problem["canonical_solution"], FAST).passed  # the machine is still fine


def test_agreement_counts_tokens_up_to_the_first_difference():
    same = Completion("The cat sat on the mat.", ["The", " cat", " sat", " on", " the", " mat", "."], "stop")
    other = Completion("The cat lay on a rug.", ["The", " cat", " lay", " on", " a", " rug", "."], "stop")
    result = agreement([same, other], [same, same])
    assert result.exact == 0.5 and result.first_divergence == [None, 2]
    assert result.token_agreement == pytest.approx((7 + 2) / 14)
    assert result.cosine_min < result.cosine_mean < 1.0
    [identical, unrelated] = sentence_cosines(["A quiet river at dawn."] * 2,
                                              ["A quiet river at dawn.", "Stock prices fell sharply on Monday."])
    assert identical == pytest.approx(1.0, abs=1e-5) and unrelated < 0.5


@pytest.mark.processes
def test_the_cli_writes_results_and_compares_two_runs(tmp_path):
    def run(*flags: str) -> dict:
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        done = subprocess.run([sys.executable, "-m", "llmserve.cli", "eval", "--tasks", "perplexity",
                               "--ppl-tokens", "300", "--window", "128", "--stride", "64", "--kv-cache-memory-gb",
                               "0.1", "--max-model-len", "512", "--out", str(out), *flags],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "| perplexity |" in done.stdout
        return json.loads(out.read_text())

    a = run("--dtype", "float32", "--quantization", "none", "--label", "fp32")
    b = run("--dtype", "float32", "--quantization", "int4", "--label", "int4")
    assert a["tasks"]["perplexity"]["tokens"] == b["tasks"]["perplexity"]["tokens"] == 299
    assert a["tasks"]["perplexity"]["perplexity"] != b["tasks"]["perplexity"]["perplexity"]
    files = sorted(tmp_path.glob("*.json"))
    done = subprocess.run([sys.executable, "-m", "llmserve.cli", "eval", "compare", *map(str, files)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "| perplexity |" in done.stdout and "fp32" in done.stdout
    assert "%" in done.stdout.splitlines()[2]  # the relative change


class _Scripted:
    """A target whose answers are given: what the chat-style plumbing does with an answer, model aside."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.asked: list = []

    def complete(self, prompts, max_tokens, stop=None, desc=""):
        self.asked = prompts
        return [Completion(a, [], "stop") for a in self.answers]


def test_chat_style_runs_the_answers_code_block():
    from llmserve.evaluate.humaneval import code_block, evaluate

    problems = list(PROBLEMS.values())[:2]
    right = f"Here it is:\n```python\n{problems[0]['prompt']}{problems[0]['canonical_solution']}```\nDone."
    body_only = f"```\n{problems[1]['prompt']}    return None\n```"
    target = _Scripted([right, body_only])
    result = evaluate(target, problems, "chat", limits=FAST)
    assert [r.passed for r in result.results] == [True, False] and result.pass_at_1 == 0.5
    assert problems[0]["prompt"] in target.asked[0][0]["content"] and target.asked[0][0]["role"] == "user"
    assert code_block("no fence at all") == "no fence at all" and code_block("```py\nx = 1\n") == "x = 1\n"
