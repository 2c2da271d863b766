"""A sparse mixture of experts in place of the MLP (Mixtral, Qwen2-MoE).

Each expert is a `GatedMLP` of its own, so every weight format and its kernels (the int4 and int8 small-step
products included) apply to experts exactly as to a dense MLP: `quantize_model` finds their linears like any
other. The router (and Qwen2-MoE's shared-expert gate) stays in the model dtype: a `Router` is not an
`nn.Linear`, so no format takes it over; its few rows decide which experts run, and rounding them would move
tokens between experts.

A step's tokens are grouped by expert with one sort, then each expert picked by any token runs once on its
tokens' rows; experts are visited in index order, and each adds its weighted output into the tokens' rows, as
transformers does, so the sums round alike.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.mlp import GatedMLP
from llmserve.models.config import MoEConfig


class Router(nn.Module):
    """A bias-free projection to a few scores per token (the experts', or the shared expert's gate)."""

    def __init__(self, hidden_size: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, activation: str = "silu", native: bool = False) -> None:
        super().__init__()
        self.top_k, self.normalize = moe.top_k, moe.normalize_top_k
        self.tp = None  # tensor parallel: each rank holds a slice of every expert; the sum is all-reduced once
        self.gate = Router(hidden_size, moe.num_experts)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, moe.expert_intermediate_size, activation, native)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size, activation, native)
            self.shared_expert_gate = Router(hidden_size, 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (softmax over all experts in float32, then
        renormalized over the k where the family does), in the model dtype."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens, picked = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for index, n in enumerate(counts):
            if n:
                rows = tokens[start:start + n]
                out.index_add_(0, rows, self.experts[index](x[rows]) * picked[start:start + n].unsqueeze(1))
                start += n
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)
