"""The real model files tests read. Qwen2.5-Coder-0.5B's and Gemma 3 270M's are assembled by `make setup` from their
PyPI parts; a machine without one skips the tests that need it, saying why."""

from __future__ import annotations

import pytest

from llmserve.loader.default_models import PARTED_MODELS, installed_path, resolve_model_path


def _file_marks(name: str, tier_marker: str) -> tuple[str | None, pytest.MarkDecorator, list]:
    """A registered model's assembled path (None where it is not), the skip where it is missing, and that skip with
    the marker that keeps its heavier tests in the full tier."""
    path = installed_path(PARTED_MODELS[name])
    missing = pytest.mark.skipif(path is None,
                                 reason=f"{name} is not assembled here (`llmserve download {name}`; setup does it)")
    return path, missing, [missing, getattr(pytest.mark, tier_marker)]


def _with(marks: list, test):
    for mark in marks:
        test = mark(test)
    return test


QWEN = "qwen2.5-coder-0.5b"
# the `qwen` marker: a model 4x the default's size
QWEN_PATH, QWEN_FILE, QWEN_MARKS = _file_marks(QWEN, "qwen")
GEMMA3 = "gemma3-270m"
# the `gemma3` marker: a test that loads transformers' Gemma 3 or the file's 262,144-token vocabulary (seconds to
# a minute)
GEMMA3_PATH, GEMMA3_FILE, GEMMA3_MARKS = _file_marks(GEMMA3, "gemma3")


def needs_qwen_tokenizer(test):
    """A test of Qwen2.5-Coder-0.5B's tokenizer alone (a second to load): skipped without its file, fast tier."""
    return QWEN_FILE(test)


def needs_qwen(test):
    """A test of the real Qwen2.5-Coder-0.5B: skipped without its file, full tier only."""
    return _with(QWEN_MARKS, test)


def needs_gemma3_file(test):
    """A test that reads only Gemma 3 270M's header (milliseconds): skipped without its file, fast tier."""
    return GEMMA3_FILE(test)


def needs_gemma3(test):
    """A test of the real Gemma 3 270M's weights or tokenizer: skipped without its file, full tier only."""
    return _with(GEMMA3_MARKS, test)


def gguf_files() -> list:
    """The default model's file and Qwen2.5-Coder-0.5B's (Q4_1; Q4_K, Q5_0, Q6_K, Q8_0), as test parameters."""
    return [pytest.param(resolve_model_path(None)[0], id="smollm2-135m"),
            pytest.param(QWEN_PATH and str(QWEN_PATH), id=QWEN, marks=QWEN_MARKS)]
