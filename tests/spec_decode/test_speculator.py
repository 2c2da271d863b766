"""The speculator's policy: proposals only where the timed step cost and the request's acceptance say they
pay; vLLM's batch-size limit on top; the counters behind the metrics."""

from __future__ import annotations

import time

import pytest

from llmserve.config import SpeculativeConfig, engine_config
from llmserve.engine.step import ModelRunnerOutput, SchedulerOutput
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.speculator import SpecDecodeStats, Speculator, StepCost
from tests.engine.test_scheduler import make_request

REPEATING = [5, 6, 7, 8, 9, 10, 11, 12] * 3  # prompt lookup always finds what comes next


def decoding(rid: str):
    req = make_request(rid, len(REPEATING), max_tokens=50)
    req.all_token_ids[:] = REPEATING
    req.num_computed_tokens = len(REPEATING) - 1
    return req


def plain_step(speculator: Speculator, tokens: int, seconds: float) -> None:
    speculator.observe(SchedulerOutput(num_scheduled_tokens={f"x{i}": 1 for i in range(tokens)}),
                       ModelRunnerOutput(), seconds)


def verified(speculator: Speculator, rid: str, draft: list[int], accepted: int, seconds: float) -> None:
    scheduled = SchedulerOutput(num_scheduled_tokens={rid: len(draft) + 1}, spec_token_ids={rid: draft})
    speculator.observe(scheduled, ModelRunnerOutput({rid: draft[:accepted] + [0]}), seconds)


def test_step_cost_is_a_line_through_the_timed_sizes():
    cost = StepCost()
    assert cost.line() is None
    cost.observe(1, 0.010)
    intercept, per_token = cost.line()
    assert intercept + per_token == pytest.approx(0.010)  # one size: the prior slope through it
    cost.observe(5, 0.018)
    assert cost.line() == pytest.approx((0.008, 0.002))


def test_proposals_follow_the_cost_of_a_token():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    req = decoding("a")
    assert speculator.propose([req]) == {}  # nothing timed yet: the first step runs plain
    plain_step(speculator, 1, 0.010)
    plain_step(speculator, 5, 0.011)  # an extra token costs a tenth of a step: worth all four
    assert speculator.propose([req]) == {"a": [5, 6, 7, 8]}

    dear = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    plain_step(dear, 1, 0.010)
    plain_step(dear, 2, 0.020)  # every token costs a whole step: speculation can only lose
    assert dear.propose([req]) == {}


def test_each_proposal_depth_pays_what_the_proposer_takes():
    """A draft model runs a step of its own per depth: the first token at a depth also pays that (measured)."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    plain_step(speculator, 1, 0.010)
    plain_step(speculator, 5, 0.011)
    req = decoding("a")
    assert speculator.propose([req]) == {"a": [5, 6, 7, 8]}
    assert 0 < speculator.depth_cost < 0.005  # prompt lookup: next to nothing
    speculator.depth_cost = 0.002  # a draft step a fifth of the target's: a fourth token (0.75^4) no longer pays
    assert speculator.propose([req]) == {"a": [5, 6, 7]}
    speculator.depth_cost = 0.010  # a draft step as dear as the target's: none does
    assert speculator.propose([req]) == {}


class SlowFirstProposer:
    """A draft-like proposer: its first call prefills a prompt (0.2 s, reported as catch-up), later calls take
    `per_depth` seconds per depth."""

    catches_up = True

    def __init__(self, per_depth: float) -> None:
        self.per_depth = per_depth
        self.catch_up_seconds = 0.0
        self.calls = 0

    def propose(self, requests, num_tokens):
        self.calls += 1
        self.catch_up_seconds = 0.2 if self.calls == 1 else 0.0
        time.sleep(self.catch_up_seconds + self.per_depth * max(num_tokens.values()))
        return {r.request_id: [5, 6, 7, 8][: num_tokens[r.request_id]] for r in requests}


def test_a_prompts_catch_up_is_not_a_depths_cost():
    """A draft's prefill of a new prompt is paid once per request: it must not price every later depth (it
    once switched a draft model off for good after its first proposal)."""
    proposer = SlowFirstProposer(per_depth=0.0005)
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4), proposer)
    plain_step(speculator, 1, 0.030)
    plain_step(speculator, 5, 0.032)
    req = decoding("a")
    assert speculator.propose([req]) == {"a": [5, 6, 7, 8]}  # the 0.2 s catch-up ...
    assert speculator.depth_cost < 0.005  # ... is not a depth's cost
    assert speculator.propose([req]) == {"a": [5, 6, 7, 8]}


def test_an_unused_depth_cost_drifts_back_toward_trying():
    """One dear measurement (a pause, a cold cache) stops proposals; without proposals nothing re-measures
    it, so the estimate drifts down until speculation is tried again."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    plain_step(speculator, 1, 0.010)
    plain_step(speculator, 5, 0.011)
    req = decoding("a")
    speculator.depth_cost = 1.0
    steps = 0
    while not speculator.propose([req]):
        steps += 1
        assert steps < 200
    assert steps > 10
    assert speculator.depth_cost < 0.01


def test_reset_forgets_what_the_engines_own_requests_taught():
    """The compile warm-up's steps include compiling: its first 17-token step takes ~a minute, and that size's
    mean holds proposals off for good at c=1 (no 17-token step runs again to move it). The engine resets the
    speculator after its own requests; speculation then starts over as a fresh one does."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    req = decoding("a")
    plain_step(speculator, 1, 0.010)
    plain_step(speculator, 5, 0.011)
    verified(speculator, "a", [5, 6, 7, 8], accepted=0, seconds=0.011)
    plain_step(speculator, 17, 60.0)  # compiled on its first call
    assert speculator.propose([req]) == {}
    assert speculator.stats.num_drafts == 1 and speculator.acceptance("a") < Speculator(
        SpeculativeConfig()).acceptance("a")
    speculator.reset()
    assert speculator.cost.line() is None and speculator.depth_cost == 0.0
    assert speculator.stats == SpecDecodeStats()
    assert speculator.acceptance("a") == Speculator(SpeculativeConfig()).acceptance("a")
    assert speculator.propose([req]) == {}  # the first step is timed plain, as a fresh speculator's
    plain_step(speculator, 1, 0.010)
    plain_step(speculator, 5, 0.011)
    assert speculator.propose([req]) == {"a": [5, 6, 7, 8]}


def test_a_request_whose_proposals_fail_stops_and_later_tries_again():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    plain_step(speculator, 1, 0.010)
    plain_step(speculator, 5, 0.026)  # an extra token: 0.4 of a step, so a proposal kept 40 % of the time pays
    req = decoding("a")
    assert speculator.propose([req])["a"]
    for _ in range(6):
        verified(speculator, "a", [5, 6, 7, 8], accepted=0, seconds=0.026)
    assert speculator.acceptance("a") < 0.2
    assert speculator.propose([req]) == {}
    steps = 0
    while not speculator.propose([req]):
        steps += 1
        assert steps < 200
    assert steps > 5  # not at once: it recovers toward the prior step by step
    stats = speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (6, 24, 0)


def test_disable_by_batch_size_and_fixed_proposals():
    config = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2, adaptive=False)
    speculator = Speculator(config)
    a, b = decoding("a"), decoding("b")
    assert speculator.propose([a]) == {"a": [5, 6, 7]}  # not adaptive: whatever the proposer finds
    assert speculator.propose([a, b]) == {}
    near_the_end = decoding("c")
    near_the_end.max_tokens = 2  # one output token left after this step's own: one proposal
    assert speculator.propose([near_the_end]) == {"c": [5]}


@pytest.mark.parametrize("catches_up", [True, False])
def test_a_draft_never_starts_on_a_request_that_decoded_beside_others(catches_up):
    """A request that decoded while the batch-size limit held proposals off, later alone: a draft would first
    prefill its whole context, for a stretch alone the next arrival ends (0.92x served at c=2). A request the
    draft started on goes on after such a stretch; prompt lookup, which keeps no state, proposes for any."""
    proposer = SlowFirstProposer(per_depth=0.0)
    proposer.catches_up = catches_up
    config = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2, adaptive=False)
    speculator = Speculator(config, proposer)
    a, b, c = decoding("a"), decoding("b"), decoding("c")
    assert speculator.propose([c]) == {"c": [5, 6, 7]}  # alone: started
    assert speculator.propose([a, b, c]) == {}  # three running: off
    assert speculator.propose([a]) == ({} if catches_up else {"a": [5, 6, 7]})  # a alone, never started
    assert speculator.propose([c]) == {"c": [5, 6, 7]}  # started before: it goes on
    speculator.observe(SchedulerOutput(finished_request_ids={"a", "c"}), ModelRunnerOutput(), 0.01)
    again = decoding("a")  # an id used again (a new request): no history
    assert speculator.propose([again]) == {"a": [5, 6, 7]}


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "eagle", "model": "qwen2.5-coder-0.5b"}, "not supported yet"),
    ({"method": "draft_model"}, "needs a 'model'"),
    ({"method": "ngram", "model": "qwen2.5-coder-0.5b"}, "only it takes one"),
    ({"method": "ngarm"}, "unknown method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"lookahead": 3}, "unknown key"),
    ("{not json", "JSON object"),
    ("[1, 2]", "JSON object"),
])
def test_a_config_that_cannot_work_is_refused_at_start(value, message):
    with pytest.raises(ValueError, match=message):
        engine_config(speculative_config=value)


def test_the_config_forms_agree():
    as_dict = engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 5}).speculative
    as_json = engine_config(speculative_config='{"method": "ngram", "num_speculative_tokens": 5}').speculative
    assert as_dict == as_json == SpeculativeConfig(num_speculative_tokens=5)
    assert engine_config(speculative_config="ngram").speculative == SpeculativeConfig()  # a method alone
    assert engine_config(speculative_config="off").speculative is None
    assert engine_config(speculative_config=None).speculative is None
    assert engine_config().speculative == engine_config(speculative_config="auto").speculative == "auto"  # the plan's


def test_seeded_sampling_is_left_alone_in_every_configuration():
    """A seeded request that samples never gets proposals, under "auto" or a configuration the user asked for (its
    text must not depend on which steps speculated); greedy ones, seeded or not, and unseeded sampled ones do."""
    requests = [decoding(rid) for rid in "abcd"]
    for req, params in zip(requests, [SamplingParams(temperature=0, max_tokens=50),
                                      SamplingParams(temperature=0.8, seed=3, max_tokens=50),
                                      SamplingParams(temperature=0.8, max_tokens=50),
                                      SamplingParams(temperature=0, seed=3, max_tokens=50)], strict=True):
        req.params = params
    assert set(Speculator(SpeculativeConfig(adaptive=False, automatic=True)).propose(requests)) == {"a", "c", "d"}
    assert set(Speculator(SpeculativeConfig(adaptive=False)).propose(requests)) == {"a", "c", "d"}
