"""`pip install .` into a fresh virtualenv gives a working `llmserve`: the engine and the server with no extra,
serving the default model's file as the development tree does, and each optional command naming the extra it
lacks. The CPU torch wheel goes in first, as the README says (PyPI's default torch is a CUDA build)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from llmserve import LLM, SamplingParams
from llmserve.loader.default_models import resolve_model_path
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[1]
TORCH_WHEELS = Path("/opt/wheels")  # where this machine keeps the CPU build of torch (scripts/setup.sh)
PROMPT = "The capital of France is"


def _run(*cmd: str | Path, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with the CPU torch wheel and `pip install .` of a copy of this tree, nothing else."""
    if not any(TORCH_WHEELS.glob("torch-2.13.0*.whl")):
        pytest.skip(f"no CPU torch wheel in {TORCH_WHEELS}: the install would pull PyPI's CUDA build")
    base = tmp_path_factory.mktemp("install")
    source = base / "source"  # a copy: building in the tree would leave build/ and egg-info behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "llmserve", source / "llmserve", ignore=shutil.ignore_patterns("__pycache__"))
    venv = base / "venv"
    _run(sys.executable, "-m", "venv", venv)
    pip = (venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    _run(*pip, "--find-links", TORCH_WHEELS, "torch==2.13.0")
    _run(*pip, source)
    return venv


def test_the_core_install_lacks_every_extra(fresh_venv: Path) -> None:
    for module in ("redis", "hnswlib", "aiohttp", "matplotlib", "ray"):  # (PyYAML comes with transformers)
        probe = subprocess.run([fresh_venv / "bin" / "python", "-c", f"import {module}"], capture_output=True)
        assert probe.returncode != 0, f"{module} came with the core install"


@pytest.mark.parametrize(("command", "extra"), [("gateway", "gateway"), ("bench", "bench"), ("plan", "bench")])
def test_a_command_without_its_extra_names_the_install_line(fresh_venv: Path, command: str, extra: str) -> None:
    args = {"gateway": ["--upstream", "m=http://127.0.0.1:9"], "bench": ["--base-url", "http://127.0.0.1:9"],
            "plan": ["--params", "1.35e8", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--heads", "9",
                     "--hardware", "cpu-2core", "--plot", "plan.png"]}[command]
    done = subprocess.run([fresh_venv / "bin" / "llmserve", command, *args], capture_output=True, text=True,
                          timeout=120, cwd=fresh_venv)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"pip install 'llmserve[{extra}]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_installed_server_answers_as_the_development_tree(fresh_venv: Path, tmp_path: Path) -> None:
    gguf = resolve_model_path(None)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = LLM(gguf, kv_cache_memory_gb=0.1, max_model_len=512).generate([PROMPT], params, use_tqdm=False)
    server = ServerProcess(tmp_path / "server.log", gguf, "--served-model-name", "smollm2",
                           "--kv-cache-memory-gb", "0.1", "--max-model-len", "512",
                           program=(fresh_venv / "bin" / "llmserve",), common=(), cwd=tmp_path)
    try:
        server.wait_ready()
        client = OpenAI(base_url=f"{server.base}/v1", api_key="unused")
        got = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    finally:
        server.stop()
    assert got.choices[0].text == expected.outputs[0].text
    assert got.usage.completion_tokens == 12
