"""Megatron-style tensor parallelism: which slice of each weight a rank holds, and the two collectives
a forward pass needs.

Why this shape: each decoder layer splits its heads and its MLP's hidden units among the ranks. q/k/v and
gate/up are column-parallel (a rank computes its heads' / units' outputs from the whole input), o and down
row-parallel (a rank multiplies its slice of the input by its slice of the weight, and one all-reduce sums
the partial outputs): two all-reduces per layer, nothing else crosses ranks inside a layer. The embedding
and the output head are split by vocabulary rows (an all-reduce of the looked-up rows, where each token's
row lives on one rank; an all-gather of the logits). The KV cache follows the KV heads.

Sharding happens on the dense model right after it is loaded, before quantization: the int4 / int8
layers are then built from the shard as they would be from a whole weight, and a checkpoint's int4 grid
(its groups of 32 inputs) is cut along the same rows and groups (`shard_grids`), so no quantized layout
needs to know about ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from llmserve.layers.mlp import GatedMLP
from llmserve.models.config import ModelConfig
from llmserve.quantization.methods import LINEAR_METHODS, methods_of


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group, and its collectives. The group is an object
    of its own (not torch.distributed's process-wide default group), so one process can hold several
    engines, each with its group."""

    rank: int
    size: int
    group: dist.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place)."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [N, k] side by side: [N, size * k]."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=1)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The whole vocabulary's logits [N, vocab] from each rank's `vocab_rows` columns."""
        share = -(-vocab_size // self.size)
        if logits.shape[1] < share:  # the last rank's short share, padded so every rank sends one shape
            logits = nn.functional.pad(logits, (0, share - logits.shape[1]), value=float("-inf"))
        return self.all_gather_columns(logits)[:, :vocab_size]

    def split(self, n: int) -> slice:
        """This rank's share of n items split evenly (n divisible by size)."""
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def vocab_rows(self, vocab_size: int) -> slice:
        """This rank's vocabulary rows: ceil(vocab / size) each, the last rank's fewer where it does not divide."""
        share = -(-vocab_size // self.size)
        return slice(min(self.rank * share, vocab_size), min((self.rank + 1) * share, vocab_size))


def check_shardable(cfg: ModelConfig, size: int, weights: str = "as loaded") -> None:
    """ValueError unless the model's heads and MLP split evenly over `size` ranks (and, with quantized `weights`,
    every row-parallel slice holds whole groups of its formats' inputs: `LinearMethodSpec.shard_inputs`)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    *(("MLP hidden units", units) for units in _mlp_widths(cfg))):
        if n % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {n} {what}")
    methods = [] if weights == "as loaded" else [LINEAR_METHODS[m] for m in methods_of(weights)]
    for spec in methods:
        for what, n in (("o_proj inputs", cfg.num_heads * cfg.head_dim),
                        *(("down_proj inputs", units) for units in _mlp_widths(cfg))):
            if (n // size) % spec.shard_inputs:
                raise ValueError(f"tensor_parallel_size={size}: a rank's {n // size} {what} are not whole "
                                 f"{spec.name} groups of {spec.shard_inputs}")


def _mlp_widths(cfg: ModelConfig) -> list[int]:
    """The hidden units of each kind of gated MLP the model holds: the dense one's, an expert's, a shared expert's."""
    moe = cfg.moe
    if moe is None:
        return [cfg.intermediate_size]
    return [w for w in (cfg.intermediate_size if moe.dense_layers else 0, moe.expert_intermediate_size,
                        moe.shared_expert_intermediate_size) if w]


def _mlp_width(cfg: ModelConfig, name: str) -> int:
    """The hidden units of the gated MLP a weight named `name` belongs to."""
    if ".experts." in name:
        return cfg.moe.expert_intermediate_size
    if ".shared_expert." in name:
        return cfg.moe.shared_expert_intermediate_size
    return cfg.intermediate_size


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shape of a layer: its heads, KV heads and MLP units, each expert's included (the vocabulary
    stays whole here)."""
    moe = cfg.moe and dataclasses.replace(
        cfg.moe, expert_intermediate_size=cfg.moe.expert_intermediate_size // size,
        shared_expert_intermediate_size=cfg.moe.shared_expert_intermediate_size // size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size, moe=moe)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding: a token whose row lives elsewhere looks up zeros, and the
    all-reduce adds the one rank's row to the others' zeros (exact)."""

    def __init__(self, weight: torch.Tensor, rows: slice, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end = rows.start, rows.stop
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        x = nn.functional.embedding((ids - self.start) * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


def _part_slices(cfg: ModelConfig, tp: TensorParallel, mlp_width: int | None = None
                 ) -> tuple[dict[str, slice], dict[str, slice]]:
    """This rank's share of each Hugging Face weight, in that weight's own coordinates: the output rows of
    q/k/v and gate/up (column-parallel) and the input columns of o and down (row-parallel), gate/up/down of an MLP
    `mlp_width` units wide (default the dense MLP's; each expert is split as one). The one place the split is
    computed; `shard_model` offsets it into the fused weights, `shard_grids` into groups."""
    d = cfg.head_dim
    heads, kv_heads = tp.split(cfg.num_heads), tp.split(cfg.num_kv_heads)
    units = tp.split(mlp_width or cfg.intermediate_size)
    q = slice(heads.start * d, heads.stop * d)
    kv = slice(kv_heads.start * d, kv_heads.stop * d)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": units, "up_proj": units}
    return rows, {"o_proj": q, "down_proj": units}


def _shifted(part: slice, offset: int) -> slice:
    return slice(part.start + offset, part.stop + offset)


@torch.no_grad()
def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Cut a loaded dense model down to rank `tp.rank`'s slices, in place, and give its layers
    and head the collectives (`model.tp`, each layer's `tp`)."""
    cfg, part = model.config, shard_config(model.config, tp.size)
    rows, columns = _part_slices(cfg, tp)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_rows = [rows["q_proj"], _shifted(rows["k_proj"], q_size), _shifted(rows["v_proj"], q_size + kv_size)]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.qkv_proj, qkv_rows)
        _keep_columns(attn.o_proj, columns["o_proj"])
        attn.num_heads, attn.num_kv_heads = part.num_heads, part.num_kv_heads
        attn.q_size, attn.kv_size = part.num_heads * part.head_dim, part.num_kv_heads * part.head_dim
        # a dense MLP, or every expert (and a shared one) split alike: the block's sum is all-reduced once, and
        # the router (replicated) sees the whole input on every rank, so every rank picks the same experts
        gated = [mlp] if isinstance(mlp, GatedMLP) else [*mlp.experts, *([mlp.shared_expert] if mlp.shared_expert
                                                                         else [])]
        for each in gated:
            units = tp.split(each.intermediate_size)
            _keep_rows(each.gate_up_proj, [units, _shifted(units, each.intermediate_size)])
            _keep_columns(each.down_proj, units)
            each.intermediate_size = units.stop - units.start
        layer.tp = mlp.tp = tp
    vocab = tp.vocab_rows(cfg.vocab_size)
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight[vocab].clone(), vocab, tp)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        _keep_rows(model.lm_head, [vocab])
    model.lm_head.out_features = vocab.stop - vocab.start
    model.tp = tp


def shard_grids(grids: dict[str, tuple[torch.Tensor, ...]] | None, cfg: ModelConfig, tp: TensorParallel
                ) -> dict[str, tuple[torch.Tensor, ...]] | None:
    """A checkpoint's grids (Hugging Face names -> tensors [out, in / group], `int4_grids`' scale and minimum per 32
    inputs or `int8_grids`' d per 256 and sc per 16, or d per 32) cut as `shard_model` cuts their weights: the rows of
    q/k/v and gate/up, the groups of o and down. A grid whose groups this rank's columns would split is left out
    (that layer re-quantizes its slice)."""
    if not grids:
        return grids
    sharded = {}
    for name, grid in grids.items():
        rows, columns = _part_slices(cfg, tp, _mlp_width(cfg, name))
        widths = {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": _mlp_width(cfg, name)}
        part = name.split(".")[-2]
        if part in rows:
            sharded[name] = tuple(g[rows[part]].clone() for g in grid)
        elif part in columns:
            cut = columns[part]
            units = [widths[part] // g.shape[1] for g in grid]  # inputs per group, each tensor's own
            if all(cut.start % u == 0 and cut.stop % u == 0 for u in units):
                sharded[name] = tuple(g[:, cut.start // u:cut.stop // u].clone()
                                      for g, u in zip(grid, units, strict=True))
        else:  # the output head and embedding keep the whole grid, which no longer fits their rows: unused
            sharded[name] = grid
    return sharded


def _keep_rows(linear: nn.Linear, parts: list[slice]) -> None:
    linear.weight = nn.Parameter(torch.cat([linear.weight[p] for p in parts]), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([linear.bias[p] for p in parts]), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, columns: slice) -> None:
    linear.weight = nn.Parameter(linear.weight[:, columns].clone(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
