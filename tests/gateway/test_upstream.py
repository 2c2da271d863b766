from __future__ import annotations

import time

from llmserve.gateway.config import HealthConfig
from llmserve.gateway.upstream import Replica


def test_ejection_half_open_trial_and_recovery():
    health = HealthConfig(eject_after=3, eject_seconds=0.05)
    r = Replica(url="http://r", model="m")
    assert not r.failed(health, "boom") and not r.failed(health, "boom")
    assert r.available(time.monotonic())  # two failures: still in
    assert r.failed(health, "boom")  # the third ejects
    assert not r.available(time.monotonic()) and r.ejections == 1
    time.sleep(0.06)
    now = time.monotonic()
    assert r.available(now)  # half-open: one trial
    r.started(now)
    assert not r.available(now)  # only one at a time
    assert r.failed(health, "still down")  # the trial failed: out again, for twice as long
    assert r.ejection_s == 0.1 and r.ejections == 2
    r.finished()
    time.sleep(0.11)
    now = time.monotonic()
    r.started(now)
    r.succeeded()
    r.finished()
    assert r.available(time.monotonic()) and r.ejection_s == 0 and r.failures == 0 and r.outstanding == 0


def test_not_ready_gets_no_traffic():
    r = Replica(url="http://r", model="m", ready=False)
    assert not r.available(time.monotonic())
