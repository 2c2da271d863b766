"""docs/configuration.md is generated from the option definitions (scripts/config_docs.py): the committed page
must be what the generator writes today, and a change to an option's help text must show up as a stale page."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import types
from pathlib import Path

import pytest

from llmserve.config import CacheConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config_docs() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_help(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, help_text: str) -> None:
    """`cls.name` with another help text, for this test only (the CLI's flags and the page both read it)."""
    changed = copy.copy(cls.__dataclass_fields__[name])
    changed.metadata = types.MappingProxyType({**changed.metadata, "help": help_text})
    monkeypatch.setitem(cls.__dataclass_fields__, name, changed)


def test_committed_page_is_current(config_docs: types.ModuleType) -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_docs.generate(), (
        "docs/configuration.md is stale: run `.venv/bin/python scripts/config_docs.py`")


def test_check_passes_on_the_committed_page(config_docs: types.ModuleType) -> None:
    assert config_docs.main(["--check"]) == 0


def test_a_changed_help_text_makes_the_page_stale(config_docs: types.ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    before = config_docs.generate()
    _with_help(monkeypatch, CacheConfig, "block_size", "tokens per KV cache block, reworded for this test")
    after = config_docs.generate()
    assert after != before
    assert "reworded for this test" in after and "reworded for this test" not in before
    assert config_docs.main(["--check"]) == 1  # the committed page no longer matches
    assert "+| `--block-size` | `block_size` |" in capsys.readouterr().out  # the diff names the row


def test_every_engine_option_is_on_the_page(config_docs: types.ModuleType) -> None:
    from llmserve.config import engine_options

    page = config_docs.generate()
    for name in engine_options():
        assert f"`{name}`" in page, name
    for f in dataclasses.fields(ModelConfig):
        assert " ".join(f.metadata["help"].replace("%%", "%").split()) in page, f.name


def test_a_gateway_setting_without_a_note_fails_the_generation(config_docs: types.ModuleType,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    notes = {**config_docs.KEY_NOTES, "HealthConfig": dict(config_docs.KEY_NOTES["HealthConfig"])}
    del notes["HealthConfig"]["timeout"]
    monkeypatch.setattr(config_docs, "KEY_NOTES", notes)
    with pytest.raises(SystemExit, match="HealthConfig.timeout"):
        config_docs.generate()
