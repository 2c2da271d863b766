"""Token selection for one step's batch of sampled rows, in batched tensor ops.

Random draws use the exponential-race form of sampling (argmax of p / q with q ~ Exp(1)), so a
seeded request draws its noise from its own generator: its tokens do not depend on its batch.
Reported logprobs are those of the raw model distribution, before penalties and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] float32, 0 = greedy; None where every row is (all_greedy)
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] long, vocab size where off
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    generators: list[torch.Generator | None]
    # penalties (None when no row uses them)
    output_counts: torch.Tensor | None  # [B, V] counts of each token in the output so far
    prompt_mask: torch.Tensor | None  # [B, V] bool, token appears in the prompt
    presence_penalty: torch.Tensor | None  # [B]
    frequency_penalty: torch.Tensor | None  # [B]
    repetition_penalty: torch.Tensor | None  # [B]
    banned: list[tuple[int, list[int]]]  # (row, token ids) that may not be sampled yet (min_tokens)
    num_logprobs: list[int | None]  # per row: top-k logprobs wanted, None = none
    # constrained rows and their allowed tokens: ([n] row indices, [n, ceil(V / 32)] int32 bitmasks)
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # logit_bias: ([m] rows, [m] token ids, [m] float32 values), added to the logits before anything else
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def reads_logits(self) -> bool:
        """Whether sampling reads more of the logits than each row's maximum (draws, logprobs, or anything that
        changes them first): then they must be float32; a plain greedy step takes the head's output as it is."""
        return not (self.all_greedy and self.bias is None and not self.banned and self.allowed is None
                    and self.output_counts is None and all(k is None for k in self.num_logprobs))


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


def sample(logits: torch.Tensor, meta: SamplingMetadata, native_argmax: bool = False) -> list[SampledToken]:
    """logits: [B, V] float32 (modified in place; any float dtype where `meta.reads_logits` is False: each row's
    maximum is all that is read). `native_argmax`: greedy tokens through
    `llmserve::argmax_rows` (loaded by the caller; CPU), faster than PyTorch's reduction."""
    raw_logprobs = apply_constraints(logits, meta)
    tokens = greedy_tokens(logits, native_argmax)
    if not meta.all_greedy:
        tokens = torch.where(meta.temperature == 0, tokens, exponential_race(target_probs(logits, meta),
                                                                             meta.generators))
    token_list = tokens.tolist()
    if raw_logprobs is None:
        return [SampledToken(t) for t in token_list]
    return with_logprobs(raw_logprobs, tokens, token_list, meta.num_logprobs)


def apply_constraints(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor | None:
    """Add the logit biases, ban what may not be sampled yet and apply the penalties, in place; returns the raw
    distribution's logprobs first (None when no row wants logprobs)."""
    want_logprobs = any(k is not None for k in meta.num_logprobs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if meta.bias is not None:
        rows, ids, values = meta.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    for row, ids in meta.banned:
        logits[row, ids] = float("-inf")
    if meta.allowed is not None:
        _apply_token_bitmask(logits, *meta.allowed)
    if meta.output_counts is not None:
        _apply_penalties(logits, meta)
    return raw_logprobs


def greedy_tokens(logits: torch.Tensor, native_argmax: bool) -> torch.Tensor:
    if native_argmax:
        return torch.ops.llmserve.argmax_rows(logits)
    return logits.max(dim=-1).indices  # the first maximum, as argmax, faster than it on CPU


def _apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Tokens whose bit is clear in their row's bitmask get -inf. The int32 words are little-endian, so bit t of
    the bitmask's bytes is token t: numpy unpacks them in one call, faster than shifts in torch or a byte lookup
    table (docs/performance.md, "Structured outputs")."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    refused = ~torch.from_numpy(bits.view(np.bool_)).to(logits.device, non_blocking=True)
    if len(rows) == len(logits):  # every row constrained, in order
        logits.masked_fill_(refused, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(refused, float("-inf"))


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    counts = meta.output_counts
    seen = (counts > 0) | meta.prompt_mask
    rep = meta.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= meta.frequency_penalty.unsqueeze(1) * counts
    logits -= meta.presence_penalty.unsqueeze(1) * (counts > 0).float()


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from (normalised): temperature, then top-k, min-p and top-p
    (rows at temperature 0 get their plain softmax: the caller takes their argmax instead)."""
    temperature = torch.where(meta.temperature == 0, torch.ones_like(meta.temperature), meta.temperature)
    logits = logits / temperature.unsqueeze(1)
    if meta.top_k is not None:
        kth = logits.topk(int(meta.top_k.max()), dim=-1).values
        threshold = kth.gather(1, (meta.top_k - 1).clamp(max=kth.shape[1] - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        floor = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if meta.top_p is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        sorted_probs = sorted_probs.masked_fill(before >= meta.top_p.unsqueeze(1), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if meta.min_p is not None or meta.top_p is not None:
        probs = probs / probs.sum(dim=-1, keepdim=True)  # what they left, renormalised
    return probs


def exponential_race(weights: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row, proportional to `weights` (need not sum to 1); a row with a generator draws its
    noise from it, rows in order."""
    noise = torch.empty_like(weights)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), weights.shape[1]).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (weights / noise).argmax(dim=-1)


def with_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, token_list: list[int], wanted: list[int | None]
) -> list[SampledToken]:
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    k = max((n for n in wanted if n), default=0)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
    top_vals_l = top_vals.tolist() if k else None
    top_ids_l = top_ids.tolist() if k else None
    out = []
    for i, token in enumerate(token_list):
        if wanted[i] is None:
            out.append(SampledToken(token))
            continue
        top = list(zip(top_ids_l[i][: wanted[i]], top_vals_l[i][: wanted[i]], strict=True)) if wanted[i] else []
        out.append(SampledToken(token, chosen_l[i], ranks_l[i], top))
    return out
