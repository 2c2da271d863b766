"""`same_tokenizer`: two models share one loaded tokenizer only when their tokenizer files are identical."""

from __future__ import annotations

from pathlib import Path

from llmserve.loader import load_tokenizer, same_tokenizer, tokenizer_files
from llmserve.loader.default_models import resolve_model_path
from tests.model_files import QWEN, needs_qwen


def test_a_converted_gguf_tokenizer_is_the_same_as_itself():
    load_tokenizer(None)  # converted and cached at its first load
    assert "tokenizer.json" in tokenizer_files(None)
    assert same_tokenizer(None, resolve_model_path(None)[0])


@needs_qwen
def test_models_with_other_vocabularies_differ():
    load_tokenizer(QWEN)
    assert not same_tokenizer(None, QWEN)


def test_a_gguf_file_not_converted_yet_shares_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))  # an empty cache: the default's tokenizer not converted
    assert tokenizer_files(None) == {}
    assert not same_tokenizer(None, None)


def test_directories_match_on_every_tokenizer_file(tmp_path: Path):
    tokenizer = load_tokenizer(None)
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        tokenizer.save_pretrained(folder)
        (folder / "config.json").write_text("{}")  # a model's config beside them does not take part
    (b / "config.json").write_text('{"other": 1}')
    assert same_tokenizer(str(a), str(b))
    config = b / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length"', '"model_max_length_"'))
    assert not same_tokenizer(str(a), str(b))

