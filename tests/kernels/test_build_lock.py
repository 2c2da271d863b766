"""A kernel build that was killed leaves torch's lock file behind; the next start must not wait on it
forever, and a build still running (a fresh lock) must not be disturbed."""

from __future__ import annotations

import os
import time

from llmserve.kernels import STALE_BUILD_LOCK_S, clear_stale_build_lock


def test_a_killed_build_s_lock_is_removed_and_a_running_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_build_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_build_lock(tmp_path) and not lock.exists()
    assert not clear_stale_build_lock(tmp_path)  # nothing left to remove
