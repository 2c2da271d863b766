"""The client libraries applications are written in, each running its own quick-start (chat, stream, structured
output in the library's default mode, one tool) against `llmserve serve qwen2.5-coder-0.5b` as it starts with no
flags, and through the gateway in front of it.

Each library runs from PyPI in its own virtualenv (tests/clients/venvs.py); its script (tests/clients/quickstarts/)
reports every step as `ok`, `model` or `server`. A `server` outcome fails the test. A `model` outcome is the 0.5B
model's own choice after the server did its part (it calls the tool again after the tool's result, or writes the
call as a fenced code block): reported, never a failure. What the server guarantees (a forced tool call, an
output constrained to a schema, a stream that adds up to the answer) is checked as `server`.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.clients.venvs import venv_python
from tests.gateway.conftest import GatewayProcess
from tests.model_files import QWEN_MARKS
from tests.server.conftest import ServerProcess

MODEL = "qwen2.5-coder-0.5b"
SCRIPTS = Path(__file__).parent / "quickstarts"
STEPS = ("chat", "stream", "structured", "tool")

pytestmark = [pytest.mark.clients, *QWEN_MARKS]


@dataclass(frozen=True)
class ClientLibrary:
    name: str
    script: str
    requirements: tuple[str, ...] = ()  # empty: the project's own environment has it (its test extra)
    extra_steps: tuple[str, ...] = ()

    @property
    def steps(self) -> tuple[str, ...]:
        return STEPS + self.extra_steps


# Pinned to the releases last checked; a newer release is a one-line change here, and a run of this suite.
LIBRARIES = (
    ClientLibrary("openai", "openai_sdk.py", extra_steps=("responses",)),
    ClientLibrary("openai-2", "openai_sdk.py", ("openai==2.54.0",), extra_steps=("responses",)),
    ClientLibrary("openai-agents", "openai_agents_quickstart.py"),
    ClientLibrary("instructor", "instructor_quickstart.py", ("instructor==1.17.0",)),
    ClientLibrary("litellm", "litellm_quickstart.py", ("litellm==1.110.2",)),
    ClientLibrary("langchain-openai", "langchain_quickstart.py", ("langchain-openai==1.7.4",),
                  extra_steps=("responses",)),
    ClientLibrary("pydantic-ai", "pydantic_ai_quickstart.py", ("pydantic-ai-slim[openai]==2.68.0",)),
    ClientLibrary("llama-index", "llama_index_quickstart.py", ("llama-index-llms-openai-like==0.8.1",)),
)


@pytest.fixture(scope="module")
def pythons() -> dict[str, Path]:
    """Every library's interpreter, the missing virtualenvs built side by side (pip waits on the network)."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {lib.name: pool.submit(venv_python, lib.name, lib.requirements)
                   for lib in LIBRARIES if lib.requirements}
        built = {name: future.result() for name, future in futures.items()}
    return {lib.name: built.get(lib.name, Path(sys.executable)) for lib in LIBRARIES}


@pytest.fixture(scope="module")
def qwen_default(tmp_path_factory) -> ServerProcess:
    """`llmserve serve qwen2.5-coder-0.5b` with no tuning flags: what a user starts."""
    proc = ServerProcess(tmp_path_factory.mktemp("clients") / "qwen.log", MODEL, common=["--no-access-log"])
    try:
        proc.wait_ready(300)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def qwen_gateway(tmp_path_factory, qwen_default: ServerProcess) -> GatewayProcess:
    """The gateway as configured by default (its exact cache on) in front of that server."""
    proc = GatewayProcess(tmp_path_factory.mktemp("clients-gateway"), {"models": {MODEL: {
        "upstreams": [qwen_default.base]}}, "health": {"interval": 0.5, "timeout": 5.0}})
    yield proc
    proc.stop()


@pytest.mark.parametrize("target", ["server", "gateway"])
@pytest.mark.parametrize("library", LIBRARIES, ids=lambda lib: lib.name)
def test_quick_start(library: ClientLibrary, target: str, pythons, qwen_default, qwen_gateway):
    base = (qwen_default if target == "server" else qwen_gateway).base
    done = subprocess.run([str(pythons[library.name]), library.script, "--base-url", f"{base}/v1", "--model", MODEL],
                          cwd=SCRIPTS, capture_output=True, text=True, timeout=600)
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    outcomes = {r["step"]: r["outcome"] for r in reports}
    for r in reports:  # shown with -rA and when the test fails
        print(f"{r['library']} {r['version']} {r['step']}: {r['outcome']} ({r['seconds']} s) {r['detail'][:300]}")
    assert tuple(outcomes) == library.steps, f"steps reported: {list(outcomes)}\n{done.stderr[-3000:]}"
    defects = [f"{r['step']}: {r['detail']}" for r in reports if r["outcome"] == "server"]
    assert not defects, "\n\n".join(defects)
    assert done.returncode == 0, done.stderr[-3000:]
    # what never depends on the model's choices: a text answer, its stream, a constrained output
    assert [outcomes[s] for s in ("chat", "stream", "structured")] == ["ok"] * 3
