"""Sampler filters and penalties on hand-made logits, where the right answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.kernels import load_cpu_kernels
from llmserve.layers.sampler import SamplingMetadata, sample


def _meta(b: int, **kw) -> SamplingMetadata:
    base = dict(
        temperature=torch.ones(b), all_greedy=False, top_k=None, top_p=None, min_p=None,
        generators=[torch.Generator().manual_seed(i) for i in range(b)], output_counts=None, prompt_mask=None,
        presence_penalty=None, frequency_penalty=None, repetition_penalty=None, banned=[], num_logprobs=[None] * b,
    )
    base.update(kw)
    return SamplingMetadata(**base)


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def _draws(n: int = 400, **kw) -> set[int]:
    logits = LOGITS.repeat(n, 1)
    return {t.token_id for t in sample(logits.clone(), _meta(n, **kw))}


def test_unfiltered_sampling_reaches_every_token_and_filters_cut_the_tail():
    assert _draws() == {0, 1, 2, 3}
    assert _draws(top_k=torch.full((400,), 2)) == {0, 1}
    assert _draws(top_p=torch.full((400,), 0.7)) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert _draws(top_p=torch.full((400,), 0.5)) == {0}
    assert _draws(min_p=torch.full((400,), 0.5)) == {0, 1}  # floor 0.25
    assert _draws(temperature=torch.zeros(400)) == {0}


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = LOGITS.repeat(3, 1)
    gens = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    first = [t.token_id for t in sample(logits.clone(), _meta(3, generators=gens))]
    again = [torch.Generator().manual_seed(7)]
    alone = sample(LOGITS.unsqueeze(0).clone(), _meta(1, generators=again))[0].token_id
    assert alone == first[2]


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    counts = torch.tensor([[3.0, 1.0, 0.0, 0.0]])
    prompt = torch.tensor([[False, False, True, False]])
    meta = _meta(
        1, temperature=torch.zeros(1), all_greedy=True, output_counts=counts, prompt_mask=prompt,
        presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
        repetition_penalty=torch.tensor([2.0]),
    )
    work = logits.clone()
    sample(work, meta)
    # repetition: positive / 2, negative * 2 (seen in prompt or output); then -0.25*count - 0.5*(count>0)
    expected = torch.tensor([[2.0 / 2 - 0.75 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2, 0.0]])
    assert torch.allclose(work, expected)


def test_banned_tokens_are_never_sampled_and_logprobs_are_raw():
    logits = LOGITS.unsqueeze(0).clone()
    [tok] = sample(logits, _meta(1, temperature=torch.zeros(1), all_greedy=True, banned=[(0, [0])],
                                 num_logprobs=[2]))
    assert tok.token_id == 1
    assert tok.rank == 2  # rank in the raw distribution, where token 0 is still the best
    assert [t for t, _ in tok.top] == [0, 1]
    assert abs(tok.logprob - float(torch.log(torch.tensor(0.3)))) < 1e-5


def test_logit_bias_moves_its_rows_tokens_before_bans_and_leaves_reported_logprobs_alone():
    logits = LOGITS.repeat(3, 1)
    bias = (torch.tensor([0, 1, 1]), torch.tensor([3, 3, 0]), torch.tensor([10.0, 2.0, -100.0]))
    # row 0: token 3 lifted far past the rest; row 1: token 0 sunk and token 3 up by 2 (0.05 e^2 = 0.37 > 0.3);
    # row 2 untouched
    greedy = sample(logits.clone(), _meta(3, temperature=torch.zeros(3), all_greedy=True, bias=bias,
                                          num_logprobs=[0, None, 0]))
    assert [t.token_id for t in greedy] == [3, 3, 0]
    assert greedy[0].logprob == pytest.approx(math.log(0.05), abs=1e-5)  # the model's own, not the biased one
    banned = sample(logits.clone(), _meta(3, temperature=torch.zeros(3), all_greedy=True, bias=bias,
                                          banned=[(0, [3])]))
    assert banned[0].token_id == 0  # a ban outranks a bias
    drawn = {t.token_id for t in sample(LOGITS.repeat(400, 1), _meta(400, bias=(
        torch.arange(400), torch.zeros(400, dtype=torch.long), torch.full((400,), -100.0))))}
    assert drawn == {1, 2, 3}  # -100 takes a token out of sampling


def test_only_a_plain_greedy_step_takes_logits_as_they_are():
    """`reads_logits` is False only where each row's maximum is all sampling reads; there the head's bfloat16 output
    gives the tokens its float32 copy gives (ties and all), on both argmax paths."""
    greedy = dict(temperature=torch.zeros(2), all_greedy=True)
    assert not _meta(2, **greedy).reads_logits
    assert _meta(2).reads_logits  # draws
    assert _meta(2, **greedy, num_logprobs=[None, 3]).reads_logits
    assert _meta(2, **greedy, banned=[(0, [1])]).reads_logits
    assert _meta(2, **greedy, allowed=(torch.tensor([0]), torch.ones(1, 1, dtype=torch.int32))).reads_logits
    assert _meta(2, **greedy, bias=(torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]))).reads_logits
    assert _meta(2, **greedy, output_counts=torch.zeros(2, 4), prompt_mask=torch.zeros(2, 4, dtype=torch.bool),
                 presence_penalty=torch.zeros(2), frequency_penalty=torch.zeros(2),
                 repetition_penalty=torch.ones(2)).reads_logits
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits[1, 7] = logits[1, 9000] = 30.0  # a tie: the first wins
    want = [t.token_id for t in sample(logits.float(), _meta(2, **greedy))]
    assert want[1] == 7
    for native in (False, True) if load_cpu_kernels() else (False,):
        assert [t.token_id for t in sample(logits.clone(), _meta(2, **greedy), native_argmax=native)] == want
