from __future__ import annotations

from llmserve.gateway.balancing import CHUNK_CHARS, LeastOutstanding, PrefixAware, RoundRobin, prefix_chunks
from llmserve.gateway.upstream import Replica


def fleet(n: int = 3) -> list[Replica]:
    return [Replica(url=f"http://r{i}", model="m") for i in range(n)]


def chat(system: str, user: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_round_robin_and_least_outstanding():
    replicas = fleet()
    rr = RoundRobin()
    assert [rr.pick(replicas, []).url for _ in range(4)] == ["http://r0", "http://r1", "http://r2", "http://r0"]
    replicas[0].outstanding, replicas[1].outstanding, replicas[2].outstanding = 3, 1, 1
    lo = LeastOutstanding()
    assert {lo.pick(replicas, []).url for _ in range(4)} == {"http://r1", "http://r2"}  # ties share


def test_prefix_chunks_chain_whole_chunks_only():
    system = "x" * (CHUNK_CHARS * 2)
    a, b = prefix_chunks(chat(system, "one")), prefix_chunks(chat(system, "two"))
    assert len(a) == 2 and a == b  # the user turns differ only past the last whole chunk
    c = prefix_chunks(chat("y" + system[1:], "one"))
    assert c[0] != a[0] and c[1] != a[1]  # chained: a change early changes every later hash
    assert prefix_chunks({"model": "m", "prompt": "short"}) == []


def test_prefix_aware_keeps_a_prefix_on_one_replica_and_spreads_new_ones():
    replicas = fleet()
    policy = PrefixAware(slack=2)
    systems = [f"system prompt number {i} " * 40 for i in range(3)]
    homes = {}
    for round_ in range(3):
        for i, system in enumerate(systems):
            chosen = policy.pick(replicas, prefix_chunks(chat(system, f"question {round_}")))
            homes.setdefault(i, chosen.url)
            assert chosen.url == homes[i]
    assert len(set(homes.values())) == 3  # cold prefixes went to the least loaded replicas, round the ring


def test_prefix_aware_gives_way_only_when_the_warm_replica_is_overloaded():
    replicas = fleet(2)
    policy = PrefixAware(slack=2)
    prefix = prefix_chunks(chat("shared " * 100, "q"))
    warm = policy.pick(replicas, prefix)
    warm.outstanding = 2  # within slack of the other (0): stay warm
    assert policy.pick(replicas, prefix) is warm
    warm.outstanding = 3  # past it: the least loaded takes it
    assert policy.pick(replicas, prefix) is not warm
