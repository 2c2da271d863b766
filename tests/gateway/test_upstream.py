from __future__ import annotations

import time

from llmserve.gateway.config import GatewayConfig, HealthConfig, parse_upstream
from llmserve.gateway.upstream import Replica, UpstreamPool


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


def test_probes_without_an_answer_mark_a_replica_down_only_after_several():
    """A replica busy with a full batch may answer its probe late while serving well: one late probe must not
    take it out; its own non-200 does at once; a request it answers counts as a probe that passed."""
    health = HealthConfig(down_after=3)
    r = Replica(url="http://r", model="m")
    r.probed(200, health)
    r.probed(None, health)
    r.probed(None, health)
    assert r.ready  # two probes without an answer: still in
    r.probed(None, health)
    assert not r.ready
    r.succeeded()  # traffic it served: alive
    assert r.ready and r.probe_failures == 0
    r.probed(503, health)  # its own word (draining, loading): out at once, and only a 200 brings it back
    assert not r.ready
    r.succeeded()
    assert not r.ready
    r.probed(200, health)
    assert r.ready
    fresh = Replica(url="http://new", model="m")
    fresh.probed(None, health)  # never seen healthy (still starting): down at the first silence
    assert not fresh.ready


def test_when_no_replica_is_available_the_least_bad_is_tried():
    config = GatewayConfig(models={"m": parse_upstream("m=http://a,http://b,http://c")})
    pool = UpstreamPool(config)
    a, b, c = pool.replicas["m"]
    assert pool.candidates("m") == [a, b, c]
    for r in (a, b, c):
        r.ready = False
    a.ejected_until = time.monotonic() + 30  # ejected: worst
    b.probe_failures = 3
    c.probe_failures = 5
    assert pool.available("m") == [] and pool.candidates("m") == [b, c, a]
