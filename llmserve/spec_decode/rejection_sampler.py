"""Verification of proposed tokens: keep the longest prefix the target model agrees with, plus one token
of its own, so that the output follows the target's distribution exactly.

Each verified request brings `len(draft) + 1` rows of target logits: row j scores the token after draft
token j - 1 (row 0: after the request's last real token). Rows are constrained (bans, penalties) as a
plain step would constrain them, given the draft tokens before them.
- Greedy rows: draft token j is kept iff it is the target's argmax at row j; the first mismatch is
  replaced by that argmax; all kept, the last row's argmax follows. Token for token what decoding one
  token a step gives.
- Random rows: speculative sampling (Leviathan et al. 2023; Chen et al. 2023). Draft token x, proposed
  with probability q(x), is kept with probability min(1, p(x) / q(x)), p the target's distribution after
  temperature, top-k, min-p and top-p; the first rejected one is replaced by a draw from
  max(p - q, 0) (normalised); all kept, a draw from the last row's p follows. An n-gram proposal is
  deterministic (q one-hot): keep x with probability p(x), else draw from p without x.
"""

from __future__ import annotations

import torch

from llmserve.layers.sampler import (
    SampledToken,
    SamplingMetadata,
    apply_constraints,
    exponential_race,
    greedy_tokens,
    target_probs,
    with_logprobs,
)


def verify(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    drafts: list[list[int]],
    native_argmax: bool = False,
    draft_probs: list[torch.Tensor | None] | None = None,
) -> list[list[SampledToken]]:
    """logits [R, V] float32 (modified in place), `len(drafts[g]) + 1` consecutive rows per request g (a
    request with no draft: one row, a plain sample); `meta` per row. `draft_probs[g]`: the proposer's
    distributions [len(drafts[g]), V] (None: a deterministic proposal). Returns each request's tokens."""
    raw_logprobs = apply_constraints(logits, meta)
    greedy = greedy_tokens(logits, native_argmax).tolist()
    first_rows = [0]
    for draft in drafts:
        first_rows.append(first_rows[-1] + len(draft) + 1)
    accept = replacement = None
    if not meta.all_greedy:
        accept, replacement = _speculative_sampling(logits, meta, drafts, first_rows, draft_probs)
    greedy_rows = [True] * len(logits) if meta.all_greedy else (meta.temperature == 0).tolist()

    chosen: list[list[tuple[int, int]]] = []  # per request: (row, token)
    for g, draft in enumerate(drafts):
        first = first_rows[g]
        tokens = []
        for j, proposed in enumerate(draft):
            row = first + j
            kept = proposed == greedy[row] if greedy_rows[row] else accept[row]
            if not kept:
                tokens.append((row, greedy[row] if greedy_rows[row] else replacement[row]))
                break
            tokens.append((row, proposed))
        else:
            row = first + len(draft)
            tokens.append((row, greedy[row] if greedy_rows[row] else replacement[row]))
        chosen.append(tokens)
    if raw_logprobs is None:
        return [[SampledToken(t) for _, t in tokens] for tokens in chosen]
    rows = [row for tokens in chosen for row, _ in tokens]
    token_list = [t for tokens in chosen for _, t in tokens]
    sampled = iter(with_logprobs(raw_logprobs[rows], torch.tensor(token_list), token_list,
                                 [meta.num_logprobs[r] for r in rows]))
    return [[next(sampled) for _ in tokens] for tokens in chosen]


def _speculative_sampling(
    logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]], first_rows: list[int],
    draft_probs: list[torch.Tensor | None] | None,
) -> tuple[list[bool], list[int]]:
    """Per row: whether its draft token is kept (a uniform draw against p/q), and the token it is replaced
    by (a draw from the residual max(p - q, 0); on a last row, from p itself)."""
    probs = target_probs(logits, meta)
    num_rows, vocab = probs.shape
    q = torch.zeros_like(probs)  # the proposal's distribution per row (zero on last rows: the residual is p)
    draft_ids = torch.zeros(num_rows, dtype=torch.long)
    for g, draft in enumerate(drafts):
        if not draft:
            continue
        rows = slice(first_rows[g], first_rows[g] + len(draft))
        draft_ids[rows] = torch.tensor(draft)
        given = draft_probs[g] if draft_probs is not None else None
        if given is None:
            q[rows].scatter_(1, draft_ids[rows].unsqueeze(1), 1.0)
        else:
            q[rows] = given
    p_x = probs.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    q_x = q.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    uniform = _uniforms(meta.generators, drafts, first_rows)
    accept = (uniform * q_x < p_x).tolist()  # u < p/q without dividing by q = 0
    residual = (probs - q).clamp_min_(0.0)
    empty = residual.sum(dim=1) <= 0  # p == q: acceptance was certain up to rounding; draw from p
    if bool(empty.any()):
        residual[empty] = probs[empty]
    return accept, exponential_race(residual, meta.generators).tolist()


def _uniforms(generators: list[torch.Generator | None], drafts: list[list[int]], first_rows: list[int]
              ) -> torch.Tensor:
    """One U(0, 1) per row that holds a draft token (others 1: never read); a seeded request's from its own
    generator, before its rows' residual draws."""
    uniform = torch.ones(first_rows[-1])
    for g, draft in enumerate(drafts):
        if draft:
            first = first_rows[g]
            uniform[first : first + len(draft)] = torch.rand(len(draft), generator=generators[first])
    return uniform
