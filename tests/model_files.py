"""The real model files tests read. Qwen2.5-Coder-0.5B's is assembled by `make setup` from its PyPI parts; a
machine without it skips the tests that need it, saying why."""

from __future__ import annotations

import pytest

from llmserve.loader.default_models import PARTED_MODELS, installed_path, resolve_model_path

QWEN = "qwen2.5-coder-0.5b"
QWEN_PATH = installed_path(PARTED_MODELS[QWEN])
# Skipped where the file is missing; in the full tier only (the `qwen` marker: a model 4x the default's size).
QWEN_FILE = pytest.mark.skipif(QWEN_PATH is None,
                               reason=f"{QWEN} is not assembled here (`llmserve download {QWEN}`; setup does it)")
QWEN_MARKS = [QWEN_FILE, pytest.mark.qwen]


def needs_qwen_tokenizer(test):
    """A test of Qwen2.5-Coder-0.5B's tokenizer alone (a second to load): skipped without its file, fast tier."""
    return QWEN_FILE(test)


def needs_qwen(test):
    """A test of the real Qwen2.5-Coder-0.5B: skipped without its file, full tier only."""
    for mark in QWEN_MARKS:
        test = mark(test)
    return test


def gguf_files() -> list:
    """The default model's file and Qwen2.5-Coder-0.5B's (Q4_1; Q4_K, Q5_0, Q6_K, Q8_0), as test parameters."""
    return [pytest.param(resolve_model_path(None)[0], id="smollm2-135m"),
            pytest.param(QWEN_PATH and str(QWEN_PATH), id=QWEN, marks=QWEN_MARKS)]
