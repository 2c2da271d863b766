"""The real model files tests read. Qwen2.5-Coder-0.5B's is assembled by `make setup` from its PyPI parts; a
machine without it skips the tests that need it, saying why."""

from __future__ import annotations

import pytest

from llmserve.loader.default_models import PARTED_MODELS, installed_path, resolve_model_path

QWEN = "qwen2.5-coder-0.5b"
QWEN_PATH = installed_path(PARTED_MODELS[QWEN])
needs_qwen = pytest.mark.skipif(QWEN_PATH is None,
                                reason=f"{QWEN} is not assembled here (`llmserve download {QWEN}`; setup does it)")


def gguf_files() -> list:
    """The default model's file and Qwen2.5-Coder-0.5B's (Q4_1; Q4_K, Q5_0, Q6_K, Q8_0), as test parameters."""
    return [pytest.param(resolve_model_path(None)[0], id="smollm2-135m"),
            pytest.param(QWEN_PATH and str(QWEN_PATH), id=QWEN, marks=needs_qwen)]
