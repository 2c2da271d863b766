"""HumanEval pass@1, greedy: each problem's prompt completed once, the completion run against the problem's
tests in a subprocess of its own, never in the evaluating (or serving) process.

The sandbox is a fresh `python -I` (isolated mode: no user site, no PYTHON* variables) in an empty
temporary folder, in a session of its own, with limits on address space, CPU seconds, file size and
open files, and a wall-clock timeout after which the whole process group is killed. That stops a
completion that loops, allocates without bound, forks or writes files from taking the machine; it is no
security boundary against hostile code (no seccomp, no network namespace): run untrusted models'
completions in a container too.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# Where a completion stops: the next top-level statement (the usual HumanEval stop sequences).
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]
# An instruct model asked as a user would ask it (as EvalPlus asks chat models); its first ```python block
# is the answer.
CHAT_PROMPT = ("Complete the following Python function. Reply with the complete function, its imports included, "
               "in one ```python code block.\n\n```python\n{prompt}```")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    memory_mb: int = 1024
    file_mb: int = 16
    open_files: int = 64


@dataclass
class ProblemResult:
    task_id: str
    passed: bool
    reason: str  # "passed", "failed: <last line of stderr>", "timeout", ...
    completion: str = ""


@dataclass
class HumanEvalResult:
    pass_at_1: float
    passed: int
    problems: int
    results: list[ProblemResult] = field(default_factory=list)


def code_block(text: str) -> str:
    """The first fenced code block of a chat answer (```python or ```), or the whole text if it has none."""
    start = text.find("```")
    if start < 0:
        return text
    body = text[text.find("\n", start) + 1 :] if text.find("\n", start) >= 0 else ""
    end = body.find("```")
    return body if end < 0 else body[:end]


def program(problem: dict, completion: str) -> str:
    """What runs in the sandbox: the prompt, the completion, the tests, the check of the entry point."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_completion(problem: dict, completion: str, limits: SandboxLimits = SandboxLimits()) -> ProblemResult:
    """Run one completion against its problem's tests in a sandboxed subprocess."""

    def limit() -> None:  # in the child, before python starts
        mem = limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        cpu = int(limits.timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        size = limits.file_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))

    with tempfile.TemporaryDirectory(prefix="humaneval-") as cwd:
        proc = subprocess.Popen([sys.executable, "-I", "-c", program(problem, completion)], cwd=cwd,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8"},
                                preexec_fn=limit, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return ProblemResult(problem["task_id"], False, "timeout", completion)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode == 0:
        return ProblemResult(problem["task_id"], True, "passed", completion)
    last = (stderr.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    if proc.returncode < 0:
        last = f"killed by signal {-proc.returncode} ({last})"
    return ProblemResult(problem["task_id"], False, f"failed: {last[:200]}", completion)


def evaluate(target, problems: list[dict], style: str = "chat", max_tokens: int = 512, workers: int = 2,
             limits: SandboxLimits = SandboxLimits()) -> HumanEvalResult:
    """Greedy answers to every problem from `target`, each run in the sandbox. `style`: "chat" (the
    problem in a user message, the answer's code block after the prompt, which it redefines) or
    "completion" (the prompt continued as text, up to the next top-level statement: base models)."""
    if style == "chat":
        answers = target.complete([[{"role": "user", "content": CHAT_PROMPT.format(prompt=p["prompt"])}]
                                   for p in problems], max_tokens, desc="HumanEval")
        codes = ["\n" + code_block(a.text) for a in answers]
    elif style == "completion":
        codes = [a.text for a in target.complete([p["prompt"] for p in problems], max_tokens, stop=STOP,
                                                  desc="HumanEval")]
    else:
        raise ValueError(f"HumanEval style must be 'chat' or 'completion', got {style!r}")
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda pc: run_completion(pc[0], pc[1], limits), zip(problems, codes, strict=True)))
    passed = sum(r.passed for r in results)
    return HumanEvalResult(passed / len(results), passed, len(results), results)
