"""A quantized model as built (its packed layouts, levels and scales), kept across restarts and mapped at start.

Why: building a quantized model decodes the file's blocks, finds its levels and packs them for the kernels, the
largest share of a start (Qwen2.5-Coder-1.5B: ~15 of its ~19 s on a Zen 4 host), and every start computes the same
bytes again. A start that finds them here maps the file (`torch.load(mmap=True)`: nothing is read until used) and
skips all of it. The key is the calibration cache's (calibration_cache.py): the model's files (path, size,
modification time), the engine's configuration and resolved plan, torch's version and the CPU; the file also holds a
digest of llmserve's sources, and a model stored by other code is built again and replaces it.

Only models whose every step runs the quantized kernels (`--large-steps quantized`: no dense or int8 copy to write)
and whose build took at least `MIN_BUILD_SECONDS` are stored (a small model is built about as fast as it
would be read back), and the folder keeps the `KEEP` most recently used: a few GB at most. The file is a pickle of
our own modules in our own cache folder (`weights_only=False`); one that cannot be read costs only the build.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
import time
from pathlib import Path

import torch
from torch import nn

from llmserve.engine.heap import trim_heap
from llmserve.loader.download import cache_root
from llmserve.quantization.calibration_cache import sources_digest

logger = logging.getLogger(__name__)

MIN_BUILD_SECONDS = 2.0
KEEP = 4


def _folder() -> Path:
    return cache_root() / "prepared"


def load_prepared(key: str) -> nn.Module | None:
    """The model stored under `key` by this code, its tensors mapped from the file, or None."""
    path = _folder() / f"{key}.pt"
    if not path.exists():
        return None
    try:
        stored = torch.load(path, mmap=True, weights_only=False)
    except Exception as e:  # a truncated or foreign file: built again, and overwritten
        logger.warning("ignoring an unreadable prepared-weights file %s: %s", path, e)
        return None
    if not isinstance(stored, dict) or stored.get("sources") != sources_digest():
        return None
    model = stored.get("model")
    if not isinstance(model, nn.Module):
        return None
    os.utime(path)  # most recently used: the last to be evicted
    return model


def mapped_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """The file-mapped storages a prepared model's tensors view (one, the file's, for a model `load_prepared` read),
    for `os_pages.drop_resident_pages` once its streamed weights were copied onto huge pages."""
    storages = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())


def save_prepared(key: str, model: nn.Module, build_seconds: float) -> threading.Thread | None:
    """Store a built model under `key`, where building it took long enough to pay, in a thread of its own: writing
    a 1.5 GB model took 8-14 s on a cloud disk, which the start need not wait for. What is written is the model as
    it is now: its modules copied (its tensors shared, only read), so that what the start does next (the weights
    moved onto huge pages, as views of one arena that torch.save refuses) changes nothing written; until the write
    ends those tensors stay resident. Then evicts the least recently used beyond `KEEP`. Returns the writing thread
    (None: nothing to write). A cache that cannot be written costs the next start its build."""
    if build_seconds < MIN_BUILD_SECONDS:
        return None
    tensors = itertools.chain(model.parameters(), model.buffers())
    snapshot = copy.deepcopy(model, memo={id(t): t for t in tensors})
    writer = threading.Thread(target=_write, args=(key, [snapshot]), name="llmserve-prepared-weights", daemon=True)
    del snapshot
    writer.start()
    return writer


def _write(key: str, holder: list[nn.Module]) -> None:
    """Writes the model `holder` holds, then lets it go and hands its freed pages back (its tensors replaced since
    by the start's own copies: otherwise they would stay resident, engine/heap.py)."""
    try:
        _save(key, holder.pop())
    finally:
        trim_heap()


def _save(key: str, model: nn.Module) -> None:
    folder = _folder()
    path = folder / f"{key}.pt"
    start = time.perf_counter()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.tmp*"):  # a write that a process exiting cut short
            if time.time() - stale.stat().st_mtime > 3600:
                stale.unlink(missing_ok=True)
        torch.save({"sources": sources_digest(), "model": model}, tmp)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - a model that does not pickle (a oneDNN-packed router) or a full disk
        tmp.unlink(missing_ok=True)
        logger.warning("could not cache the prepared weights: %s", e)
        return
    logger.info("prepared weights stored in %.1fs (%.0f MB, %s): the next start maps them", time.perf_counter() - start,
                path.stat().st_size / 1e6, path)
    stored = sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in stored[KEEP:]:
        old.unlink(missing_ok=True)
