"""Scheduler decisions on real Request objects, no model: budgets, limits, preemption order."""

from __future__ import annotations

from llmserve.config import SchedulerConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.kv_cache.kv_cache_manager import KVCacheManager
from llmserve.sampling_params import SamplingParams


class _NoText:
    """Detokenizer stand-in: these tests never look at text."""

    text = output_text = ""

    def append(self, token_id, check_stop=True):
        return None

    def finish(self):
        pass


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, None, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   max_tokens, [2], _NoText())


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedule, then pretend the model ran: computed tokens advance, finished prompts gain a token."""
    out = sched.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
            if req.status.finished:
                sched.finish(req, req.status)
    return {r.request_id: n for r, n in out.scheduled}


def test_decodes_first_then_prompt_chunks_within_the_token_budget():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10,
                                      long_prefill_token_threshold=6, max_long_partial_prefills=2), kv)
    sched.add_request(make_request("a", 3))
    assert run_step(sched) == {"a": 3}
    sched.add_request(make_request("b", 20))
    # capped by the long-prefill threshold (6), then cut back to a block boundary (4)
    assert run_step(sched) == {"a": 1, "b": 4}
    assert run_step(sched) == {"a": 1, "b": 4}
    sched.add_request(make_request("c", 9))
    assert run_step(sched) == {"a": 1, "b": 4, "c": 4}  # c gets what is left (5), block-aligned
    assert run_step(sched) == {"a": 1, "b": 4, "c": 5}  # c's last chunk needs no alignment


def test_one_long_prefill_at_a_time_and_short_prompts_pass_it():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, long_prefill_token_threshold=4), kv)
    for rid, n in (("a", 12), ("b", 12), ("c", 3)):
        sched.add_request(make_request(rid, n))
    assert run_step(sched) == {"a": 4, "c": 3}  # b is long too: it waits for a's prefill, c passes it
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert run_step(sched) == {"a": 4, "c": 1}
    assert run_step(sched) == {"a": 4, "c": 1, "b": 4}  # a's last chunk is not long: b starts
    assert run_step(sched) == {"a": 1, "c": 1, "b": 4}


def test_long_prefills_limit_of_two_runs_both():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, long_prefill_token_threshold=4,
                                      max_long_partial_prefills=2), kv)
    for rid, n in (("a", 12), ("b", 12), ("c", 3)):
        sched.add_request(make_request(rid, n))
    assert run_step(sched) == {"a": 4, "b": 4, "c": 3}


def test_max_num_seqs_limits_running_requests():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), kv)
    for rid in "abc":
        sched.add_request(make_request(rid, 4))
    assert set(run_step(sched)) == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preemption_takes_the_newest_and_requeues_it_first():
    kv = KVCacheManager(6, 4)  # 24 tokens
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), kv)
    reqs = {rid: make_request(rid, 7, max_tokens=12) for rid in "abc"}
    for r in reqs.values():
        sched.add_request(r)
    assert set(run_step(sched)) == {"a", "b", "c"}  # 2 blocks each, all 6 used
    steps = 0
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        assert steps < 200
    assert sched.num_preemptions > 0
    assert reqs["a"].num_preemptions == 0  # the oldest is never the victim
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 12 for r in reqs.values())
    assert kv.num_free_blocks == 6
