"""Pipeline parallelism: which decoder layers a stage holds, and how a step's hidden states cross from one stage
to the next.

Why this shape: stage s holds a contiguous run of the decoder layers and their KV cache; the first stage also
embeds the tokens, the last one also holds the final norm and the output head and samples. A step's requests
are cut into micro-batches (`micro_batches`) that every stage runs in the same order: stage s sends a
micro-batch's hidden states to stage s + 1 without waiting for them to arrive and goes on with the next, so
while the last stage runs micro-batch 1 the first runs micro-batch 2 (GPipe's schedule, within one engine
step). The scheduler stays as it is: one step at a time, whose sampled tokens come back before the next is
planned, so a step keeps a fill-and-drain bubble of (stages - 1) / (micro-batches + stages - 1); and a step too
small to pay for the extra weight reads a micro-batch costs runs as one (`MICRO_BATCH_MIN_TOKENS`).

Every stage builds the same step inputs from the same `SchedulerOutput` (its rows, positions, block tables), so
the hidden states are the only tensor that crosses; its shape is the step's token count, known on both sides.
With tensor parallelism too, tensor-parallel rank r of a stage sends to rank r of the next (each holds the whole
hidden state after its all-reduce): one pipeline group per tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from llmserve.engine.step import SchedulerOutput
from llmserve.models.config import ModelConfig


@dataclass
class PipelineStage:
    """This process's stage of the pipeline and the point-to-point link to its neighbours (`group`: the ranks of
    its tensor-parallel column, one per stage, ranked by stage)."""

    stage: int
    size: int
    group: dist.ProcessGroup
    layers: range  # the decoder layers this stage holds (the model's own indices)
    dtype: torch.dtype  # of the hidden states that cross
    _sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list, repr=False)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def send(self, hidden: torch.Tensor) -> None:
        """To the next stage, without waiting: the tensor is kept until `flush` (gloo reads it as it goes)."""
        hidden = hidden.contiguous()
        self._sends.append((self.group.send([hidden], self.stage + 1, 0), hidden))

    def receive(self, num_tokens: int, hidden_size: int, device: torch.device) -> torch.Tensor:
        """The previous stage's hidden states for a step of `num_tokens` tokens (waits; the group's timeout)."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=self.dtype, device=device)
        self.group.recv([hidden], self.stage - 1, 0).wait()
        return hidden

    def flush(self) -> None:
        """Wait until every hidden state sent has left (at the end of a step: nothing is in flight between steps)."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()


def stage_layers(cfg: ModelConfig, size: int) -> list[range]:
    """The decoder layers of each of `size` stages, contiguous, balanced by the weights each stage streams: the last
    stage's output head counts as the layers whose weights it equals (SmolLM2's head weighs 8 of its 30 layers), so
    the last stage takes fewer layers; the other stages split the rest evenly, earlier ones taking any extra."""
    if not 1 <= size <= cfg.num_layers:
        raise ValueError(f"pipeline_parallel_size={size}: the model has {cfg.num_layers} decoder layers, at least one "
                         "a stage")
    if size == 1:
        return [range(cfg.num_layers)]
    head = cfg.vocab_size * cfg.hidden_size / _layer_weights(cfg)  # in layers
    share = (cfg.num_layers + head) / size
    last = min(max(1, round(share - head)), cfg.num_layers - (size - 1))
    rest, extra = divmod(cfg.num_layers - last, size - 1)
    counts = [rest + (s < extra) for s in range(size - 1)] + [last]
    starts = [sum(counts[:s]) for s in range(size)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


def _layer_weights(cfg: ModelConfig) -> int:
    """One decoder layer's linear weights a token reads: attention, and the dense MLP's or the experts a token runs."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (2 * q + 2 * kv)
    moe = cfg.moe
    units = cfg.intermediate_size if moe is None else (moe.top_k * moe.expert_intermediate_size
                                                      + moe.shared_expert_intermediate_size)
    return attention + 3 * cfg.hidden_size * units


def cut_to_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Keep this stage's decoder layers (in place; the others' weights are freed with them), the embedding on the
    first stage only and the output head on the last only, and give the model its stage (`model.pp`)."""
    model.layers = nn.ModuleList(model.layers[i] for i in stage.layers)
    if not stage.first:  # a tied head keeps the shared weight itself
        model.embed_tokens = None
    if not stage.last:
        model.lm_head = None
    model.pp = stage


def stage_grids(grids: dict[str, tuple[torch.Tensor, ...]] | None, layers: range
                ) -> dict[str, tuple[torch.Tensor, ...]] | None:
    """A checkpoint's grids (Hugging Face names) for a stage's layers, renamed as `cut_to_stage` renumbers them
    (layer `layers.start` becomes layer 0); other layers' grids left out, the head's and embedding's kept."""
    if not grids:
        return grids
    kept = {}
    for name, grid in grids.items():
        parts = name.split(".")
        at = parts.index("layers") if "layers" in parts else -1
        if at < 0:
            kept[name] = grid
        elif int(parts[at + 1]) in layers:
            parts[at + 1] = str(int(parts[at + 1]) - layers.start)
            kept[".".join(parts)] = grid
    return kept


# Fewer tokens than this a micro-batch cost more than the stages' overlap gives back: each micro-batch reads the
# stage's weights again and crosses to the next stage once more. Measured on SmolLM2, two stages of one thread
# (Intel Sapphire Rapids, 2026-12-04): decode steps of 8 requests 0.92x in two micro-batches, of 32 1.07x; four
# 256-token prompts 1.08x.
MICRO_BATCH_MIN_TOKENS = 16


def micro_batches(out: SchedulerOutput, count: int, min_tokens: int = MICRO_BATCH_MIN_TOKENS) -> list[list[str]]:
    """A step's requests cut into up to `count` runs of about equal tokens, at least `min_tokens` each where the step
    has more than one, in the step's order (each non-empty)."""
    ids = list(out.num_scheduled_tokens)
    count = min(count, len(ids), max(1, out.total_num_scheduled_tokens // min_tokens))
    if count <= 1:
        return [ids]
    total = out.total_num_scheduled_tokens
    batches: list[list[str]] = [[]]
    done = 0
    for i, request_id in enumerate(ids):
        left = len(ids) - i  # requests not placed yet, this one included
        # a new batch once this one holds its share, or when every later batch needs one of the requests left
        if batches[-1] and len(batches) < count and (done >= total * len(batches) / count
                                                     or left == count - len(batches)):
            batches.append([])
        batches[-1].append(request_id)
        done += out.num_scheduled_tokens[request_id]
    return batches
