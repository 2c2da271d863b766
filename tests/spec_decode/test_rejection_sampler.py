"""Verification: greedy keeps exactly the target's argmax run; sampling follows the target's distribution.

The statistical tests draw many seeded verifications of one small fixed distribution at once and compare
the kept tokens' frequencies with the target's by a chi-square test at a false-failure rate of 1e-6 (the
draws are seeded, so a pass is reproducible; the rate is what a fresh seed would risk).
"""

from __future__ import annotations

import math

import torch

from llmserve.layers.sampler import SamplingMetadata, target_probs
from llmserve.spec_decode.rejection_sampler import verify

FALSE_FAILURE_RATE = 1e-6
TARGET_LOGITS = torch.tensor([1.0, 0.2, 2.0, -1.0, 0.5, 1.5])  # a small fixed vocabulary of 6


def metadata(rows: int, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, logprobs: int | None = None) -> SamplingMetadata:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature), all_greedy=temperature == 0,
        top_k=None if top_k is None else torch.full((rows,), top_k),
        top_p=None if top_p is None else torch.full((rows,), top_p), min_p=None,
        generators=[generator] * rows, output_counts=None, prompt_mask=None, presence_penalty=None,
        frequency_penalty=None, repetition_penalty=None, banned=[], num_logprobs=[logprobs] * rows)


def chi2_survival(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square(dof): 1 - the regularized lower incomplete gamma, by its series."""
    a, z = dof / 2, x / 2
    term = total = 1.0 / a
    n = 1
    while term > 1e-16 * total:
        term *= z / (a + n)
        total += term
        n += 1
    return 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0, "a token the target never draws was drawn"
    support = probs > 0
    expected = probs[support].double() * len(tokens)
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2_survival(chi2, int(support.sum()) - 1) > FALSE_FAILURE_RATE, (counts / len(tokens), probs)


def test_greedy_keeps_the_argmax_run_and_adds_the_targets_own():
    logits = torch.full((7, 6), -1.0)
    for row, best in enumerate([2, 3, 5, 0, 4, 1, 2]):
        logits[row, best] = 1.0
    # request 0: drafts 2, 3 agree, 4 does not (the target says 5); request 1: one draft, kept, then the bonus
    # 1; request 2: no draft, a plain argmax
    out = verify(logits, metadata(7, temperature=0), [[2, 3, 4], [4], []])
    assert [[t.token_id for t in tokens] for tokens in out] == [[2, 3, 5], [4, 1], [2]]


def test_logprobs_are_the_targets_at_each_kept_position():
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    drafted = int(logits[0].argmax())
    out = verify(logits.clone(), metadata(3, temperature=0, logprobs=2), [[drafted], []])
    raw = torch.log_softmax(logits, dim=-1)
    for (row, tokens) in ((0, out[0][:1]), (1, out[0][1:]), (2, out[1])):
        [t] = tokens
        assert t.token_id == int(logits[row].argmax()) and t.rank == 1
        assert math.isclose(t.logprob, float(raw[row, t.token_id]), abs_tol=1e-6)
        assert [tid for tid, _ in t.top] == raw[row].topk(2).indices.tolist()


def _ngram_verifications(groups: int, draft: int, **sampling) -> list[list[int]]:
    logits = TARGET_LOGITS.repeat(2 * groups, 1)
    return [[t.token_id for t in tokens]
            for tokens in verify(logits, metadata(2 * groups, **sampling), [[draft]] * groups)]


def test_an_ngram_draft_leaves_the_first_token_distributed_as_the_target():
    p = TARGET_LOGITS.softmax(-1)
    out = _ngram_verifications(20000, draft=2, seed=0)
    assert_follows(torch.tensor([tokens[0] for tokens in out]), p)
    # when the draft was kept, the target's own next token follows it, drawn from p as well
    kept = [tokens[1] for tokens in out if len(tokens) == 2]
    assert len(kept) > 0.5 * len(out) * float(p[2])
    assert_follows(torch.tensor(kept), p)


def test_the_target_distribution_is_the_one_after_temperature_top_k_and_top_p():
    for sampling in ({"temperature": 0.5, "top_k": 3}, {"temperature": 1.3, "top_p": 0.7}):
        meta = metadata(1, **sampling)
        p = target_probs(TARGET_LOGITS.unsqueeze(0).clone(), meta)[0]
        assert (p == 0).sum() >= 2  # the filters did remove tokens
        # the draft (token 3) is one the filtered target never draws: always rejected, never emitted
        out = _ngram_verifications(20000, draft=3, seed=1, **sampling)
        assert_follows(torch.tensor([tokens[0] for tokens in out]), p)


def test_a_draft_models_proposals_are_corrected_to_the_target():
    groups = 20000
    generator = torch.Generator().manual_seed(2)
    q = torch.tensor([0.05, 0.05, 0.1, 0.5, 0.2, 0.1])  # a poor draft distribution
    drafts = torch.multinomial(q, groups, replacement=True, generator=generator).tolist()
    logits = TARGET_LOGITS.repeat(2 * groups, 1)
    out = verify(logits, metadata(2 * groups, seed=3), [[d] for d in drafts],
                 draft_probs=[q.unsqueeze(0)] * groups)
    assert_follows(torch.tensor([tokens[0].token_id for tokens in out]), TARGET_LOGITS.softmax(-1))


def test_a_seeded_verification_repeats_itself():
    first = _ngram_verifications(50, draft=2, seed=7)
    assert _ngram_verifications(50, draft=2, seed=7) == first
    assert _ngram_verifications(50, draft=2, seed=8) != first
