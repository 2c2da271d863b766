"""The kernels' build cache: a build that was killed leaves torch's lock file behind, and the next start must
not wait on it forever (a build still running, a fresh lock, must not be disturbed); a finished build is
loaded as it is, never rebuilt at start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from llmserve.kernels import (
    STALE_BUILD_LOCK_S,
    build_directory,
    clear_stale_build_lock,
    finished_build,
    load_cpu_kernels,
    mark_finished,
)


def test_a_killed_build_s_lock_is_removed_and_a_running_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_build_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_build_lock(tmp_path) and not lock.exists()
    assert not clear_stale_build_lock(tmp_path)  # nothing left to remove


def test_a_finished_build_is_loaded_without_rebuilding_when_the_sources_look_newer(tmp_path):
    """A fresh checkout gives unchanged sources new times; ninja would rebuild (a minute at start). The build
    directory's name is a digest of everything the build depends on, so its finished library is loaded as it is."""
    assert load_cpu_kernels()
    built = build_directory()
    assert finished_build(built) is not None  # marked by the build (or by setup's)
    copy = tmp_path / built.name
    shutil.copytree(built, copy)
    objects = sorted(copy.glob("*.o"))
    assert objects
    for path in objects:  # older than any source: ninja would rebuild every object
        os.utime(path, (0, 0))
    probe = ("import torch, llmserve.kernels as k; assert k.load_cpu_kernels(); "
             "print(torch.ops.llmserve.argmax_rows(torch.tensor([[0.0, 2.0, 1.0]])).item())")
    env = {**os.environ, "LLMSERVE_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert all(path.stat().st_mtime == 0 for path in objects)  # nothing rebuilt
    # no mark, or a mark naming a file that is not there: not a finished build
    (copy / "finished").unlink()
    assert finished_build(copy) is None
    mark_finished(copy, copy / "gone.so")
    assert finished_build(copy) is None
    mark_finished(copy, copy / "llmserve_cpu_kernels.so")
    assert finished_build(copy) == copy / "llmserve_cpu_kernels.so"
