"""A virtualenv per client library, installed from PyPI and kept between runs.

The libraries pin what we do not (instructor wants openai 3.3, llama-index openai 2.x, litellm its own range),
so none of them goes into the project's environment: each gets its own, keyed by its requirements and the
Python version, built once per machine (about half a minute each) and reused while the key holds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("LLMSERVE_CLIENT_VENVS", Path.home() / ".cache" / "llmserve" / "client-venvs"))
READY = ".ready"


def venv_python(name: str, requirements: tuple[str, ...]) -> Path:
    """The Python of `name`'s virtualenv with `requirements` installed; built when missing."""
    key = hashlib.sha256("\n".join((sys.version, *requirements)).encode()).hexdigest()[:12]
    folder = ROOT / f"{name}-{key}"
    python = folder / "bin" / "python"
    if (folder / READY).exists():
        return python
    shutil.rmtree(folder, ignore_errors=True)  # a build that stopped half-way
    folder.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)  # not this venv's, whose packages would leak in
    subprocess.run([base, "-m", "venv", str(folder)], check=True, capture_output=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           *requirements], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"pip could not install {' '.join(requirements)}:\n{done.stderr[-3000:]}")
    (folder / READY).write_text("\n".join(requirements) + "\n")
    return python
