"""Int8 activations' input ranges, kept across restarts.

Why: calibrating runs the calibration text through the model, at every start, to measure the same numbers again,
a large share of a start (docs/performance.md, "Start-up"). A start that finds its ranges here skips that pass and
builds the same int8 layers from the same values.
The key holds everything the ranges depend on: the model's files (path, size, modification time), the engine's
configuration and resolved build plan, torch's version and the CPU; the file also holds a digest of llmserve's own
sources and data, and ranges stored by other code are measured again and replace them (so the folder keeps one file
per model and configuration, not one per version). A cache that cannot be read or written costs only the measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmserve.host import cpu_flags, cpu_model
from llmserve.loader.download import cache_root

if TYPE_CHECKING:
    from llmserve.config import EngineConfig
    from llmserve.engine.build_plan import BuildPlan

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parent.parent
_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".txt", ".json")


@functools.cache
def sources_digest() -> str:
    """llmserve's own code and data, as one digest: what the measurement ran."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _files_identity(model_path: str) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of the model's file, or of every file in its directory."""
    paths = sorted(Path(model_path).rglob("*")) if os.path.isdir(model_path) else [Path(model_path)]
    return [(str(p), (s := p.stat()).st_size, s.st_mtime_ns) for p in paths if p.is_file()]


def calibration_key(model_path: str, config: EngineConfig, plan: BuildPlan) -> str:
    """The cache key of a model's ranges under an engine's configuration and resolved plan. The KV cache's size is
    left out (it follows the memory free at each start, and no range depends on it); everything else is in."""
    sized = dict(kv_cache_memory_gb=None, kv_cache_memory_fraction=0.1)
    settings = (dataclasses.replace(config, cache=dataclasses.replace(config.cache, **sized)),
                dataclasses.replace(plan, num_kv_blocks=0, reasons={}))
    parts = [_files_identity(model_path), [repr(s) for s in settings], torch.__version__, cpu_model(),
             sorted(cpu_flags())]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_root() / "calibration" / f"{key}.pt"


def load_ranges(key: str) -> dict[str, torch.Tensor] | None:
    """The ranges stored under `key` by this code, or None (none stored, stored by other code, or unreadable: then
    they are measured again, and overwrite the file)."""
    path = _path(key)
    if not path.exists():
        return None
    try:
        stored = torch.load(path, weights_only=True)
    except Exception as e:  # a truncated or foreign file
        logger.warning("ignoring an unreadable calibration cache file %s: %s", path, e)
        return None
    ranges = stored.get("ranges") if isinstance(stored, dict) else None
    if not isinstance(ranges, dict) or not all(isinstance(v, torch.Tensor) for v in ranges.values()):
        logger.warning("ignoring a calibration cache file of unexpected content: %s", path)
        return None
    return ranges if stored.get("sources") == sources_digest() else None


def save_ranges(key: str, ranges: dict[str, torch.Tensor]) -> None:
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"sources": sources_digest(), "ranges": {name: r.detach().cpu() for name, r in ranges.items()}},
                   tmp)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the next start measures again
        logger.warning("could not cache the calibration ranges: %s", e)
