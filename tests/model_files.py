"""The real model files tests read. Qwen2.5-Coder-0.5B's and Gemma 3 270M's are assembled by `make setup` from their
PyPI parts; a machine without one skips the tests that need it, saying why."""

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


GEMMA3 = "gemma3-270m"
GEMMA3_PATH = installed_path(PARTED_MODELS[GEMMA3])
GEMMA3_FILE = pytest.mark.skipif(
    GEMMA3_PATH is None, reason=f"{GEMMA3} is not assembled here (`llmserve download {GEMMA3}`; setup does it)")
# the `gemma3` marker: a test that loads transformers' Gemma 3 or the file's 262,144-token vocabulary (seconds to
# a minute), in the full tier only
GEMMA3_MARKS = [GEMMA3_FILE, pytest.mark.gemma3]


def needs_gemma3_file(test):
    """A test that reads only Gemma 3 270M's header (milliseconds): skipped without its file, fast tier."""
    return GEMMA3_FILE(test)


def needs_gemma3(test):
    """A test of the real Gemma 3 270M's weights or tokenizer: skipped without its file, full tier only."""
    for mark in GEMMA3_MARKS:
        test = mark(test)
    return test


def gguf_files() -> list:
    """The default model's file and Qwen2.5-Coder-0.5B's (Q4_1; Q4_K, Q5_0, Q6_K, Q8_0), as test parameters."""
    return [pytest.param(resolve_model_path(None)[0], id="smollm2-135m"),
            pytest.param(QWEN_PATH and str(QWEN_PATH), id=QWEN, marks=QWEN_MARKS)]
