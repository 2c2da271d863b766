"""Scheduler decisions on real Request objects, no model: budgets, limits, preemption order."""

from __future__ import annotations

from llmserve.config import SchedulerConfig
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.step import ModelRunnerOutput
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
    """Prompts of distinct tokens per request: these tests are about budgets, not prefix-cache hits."""
    first = 3 + 1000 * (ord(rid[0]) - ord("a"))
    return Request(rid, None, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   max_tokens, [2], _NoText())


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedule, then pretend the model ran: a request whose tokens are all computed samples token 7."""
    out = sched.schedule()
    sampled = {}
    for request_id, n in out.num_scheduled_tokens.items():
        req = sched.requests[request_id]
        sampled[request_id] = [7] if req.num_computed_tokens + n == req.num_tokens else []
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    return dict(out.num_scheduled_tokens)


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


def test_the_runner_is_told_what_changed_and_nothing_else():
    """New requests come whole (tokens, blocks), running ones as new blocks and counts, finished ids once."""
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), kv)
    sched.add_request(make_request("a", 6, max_tokens=3))
    out = sched.schedule()
    [new] = out.new_requests
    assert (new.request_id, new.token_ids, new.block_ids, new.num_computed_tokens) == ("a", [*range(3, 9)], [0, 1], 0)
    assert not out.running_requests and out.num_scheduled_tokens == {"a": 6}
    sched.update_from_output(out, ModelRunnerOutput({"a": [7]}))
    assert sched.requests["a"].num_computed_tokens == 6 and sched.requests["a"].output_token_ids == [7]
    out = sched.schedule()  # the 7th token: still in block 1
    assert not out.new_requests and [(r.request_id, r.new_block_ids, r.num_computed_tokens)
                                      for r in out.running_requests] == [("a", [], 6)]
    sched.update_from_output(out, ModelRunnerOutput({"a": [7]}))
    out = sched.schedule()  # the 8th token: still block 1; then the request ends at max_tokens
    updates = sched.update_from_output(out, ModelRunnerOutput({"a": [7]}))
    assert [u.new_token_ids for u in updates] == [[7]] and updates[0].request.status is RequestStatus.FINISHED_LENGTH
    assert sched.schedule().finished_request_ids == {"a"}  # told once, on the next step
    assert sched.schedule().finished_request_ids == set()
    assert kv.num_free_blocks == 100


def test_full_blocks_are_registered_only_when_computed():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6, long_prefill_token_threshold=6), kv)
    sched.add_request(make_request("a", 10))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}  # a chunk, cut back to a block boundary
    assert kv.pool.num_cached_blocks == 0
    sched.update_from_output(out, ModelRunnerOutput({"a": []}))
    assert kv.pool.num_cached_blocks == 1 and sched.requests["a"].num_computed_tokens == 4


def test_rejected_speculative_tokens_give_their_blocks_back():
    """A request runs its last token and 5 proposed ones; the runner keeps 2 of them plus one of its own:
    computed tokens count only what was kept, and blocks past them go back to the pool."""
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), kv)
    sched.add_request(make_request("a", 8, max_tokens=20))
    sched.update_from_output(out := sched.schedule(), ModelRunnerOutput({"a": [7]}))  # 9 tokens, 8 computed
    assert kv.block_ids("a") == [0, 1]
    req = sched.requests["a"]
    free_before = kv.num_free_blocks
    out = sched.schedule({"a": [50, 51, 52, 53, 54]})
    assert out.num_scheduled_tokens == {"a": 6} and out.spec_token_ids == {"a": [50, 51, 52, 53, 54]}
    assert kv.block_ids("a") == [0, 1, 2, 3]
    sched.update_from_output(out, ModelRunnerOutput({"a": [50, 51, 60]}))
    assert req.num_computed_tokens == 8 + 1 + 2  # the last token and the two accepted ones
    assert req.output_token_ids == [7, 50, 51, 60]
    assert kv.block_ids("a") == [0, 1, 2] and kv.num_free_blocks == free_before - 1  # block 3 went back
    assert kv.pool.num_cached_blocks == 2  # blocks 0-1 hold verified tokens 0-7; block 2 is not full of them


def test_proposals_fit_the_budget_and_max_tokens():
    kv = KVCacheManager(20, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4), kv)
    sched.add_request(make_request("a", 7, max_tokens=4))
    sched.add_request(make_request("b", 7, max_tokens=20))
    a, b = sched.requests["a"], sched.requests["b"]
    while b.num_output_tokens < 1:  # prompts in chunks of the budget's 4 tokens, then a decodes
        run_step(sched)
    assert a.num_output_tokens == 3 and b.num_output_tokens == 1
    out = sched.schedule({"a": [1, 2, 3, 4], "b": [5, 6, 7]})
    # a may gain one more token (its own: no proposal); b gets what is left of the budget of 4
    assert out.spec_token_ids == {"b": [5, 6]} and out.num_scheduled_tokens == {"a": 1, "b": 3}
    sched.update_from_output(out, ModelRunnerOutput({"a": [9], "b": [8]}))
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 7, 7, 9]
    assert b.num_computed_tokens == 8 and kv.block_ids("b") == kv.block_ids("b")[:2]  # both proposals rejected


def test_a_proposal_without_room_is_dropped_and_nobody_is_preempted():
    kv = KVCacheManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), kv)
    sched.add_request(make_request("a", 8, max_tokens=20))
    sched.add_request(make_request("b", 2, max_tokens=20))
    run_step(sched)  # a: 9 tokens, 2 blocks (positions 0-7 computed); b: 3 tokens, 1 block
    assert kv.num_free_blocks == 1
    # a takes the last block for its own token, its proposals would need a fourth; b's fit its block
    out = sched.schedule({"a": [1, 2, 3, 4], "b": [5]})
    assert out.spec_token_ids == {"b": [5]} and out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert not out.preempted_request_ids and kv.num_free_blocks == 0
    sched.update_from_output(out, ModelRunnerOutput({"a": [7], "b": [5, 6]}))
    out = sched.schedule({"a": [1, 2]})  # positions 9-11: a's third block
    assert out.spec_token_ids == {"a": [1, 2]} and out.num_scheduled_tokens["a"] == 3
