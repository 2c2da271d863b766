"""Fixtures for the `llmserve bench` tests: a real streaming HTTP server on a free 127.0.0.1 port and a
small real tokenizer (WordLevel, built here, so no model download is needed)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest` run without `python -m` from the repo root
    sys.path.insert(0, str(ROOT))

from llmserve.bench.tokens import TokenCounter, load_token_counter  # noqa: E402
from llmserve.bench.workload import COMMON_WORDS, PAD_WORDS  # noqa: E402

from .fake_server import FakeOpenAIServer  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeOpenAIServer]:
    srv = FakeOpenAIServer().start()
    yield srv
    srv.stop()


@pytest.fixture()
def fresh_server() -> Iterator[FakeOpenAIServer]:
    """For scenarios that depend on the server's request counter (flaky)."""
    srv = FakeOpenAIServer().start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `tokenizers` WordLevel tokenizer (one token per word / punctuation run) + a ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tok")
    vocab = {"[UNK]": 0}
    for w in [*COMMON_WORDS, *PAD_WORDS, *(f"t{i:02d}" for i in range(64))]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return d


@pytest.fixture(scope="session")
def counter(tokenizer_dir: Path) -> TokenCounter:
    return load_token_counter(str(tokenizer_dir))
