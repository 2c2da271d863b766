"""transformers as the reference implementation: the same checkpoint run by transformers' own code.

Tests compare our greedy tokens against it; benchmarks use it as the naive and static-batching
baselines. It loads GGUF files with transformers' own dequantization, so it checks our loader too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from llmserve.loader.default_models import resolve_model_path
from llmserve.loader.download import cache_root

logger = logging.getLogger(__name__)


def reference_model(model: str | None = None, dtype: torch.dtype = torch.float32):
    """A transformers `AutoModelForCausalLM` for a registered name, GGUF file or HF directory."""
    from transformers import AutoModelForCausalLM

    path, _ = resolve_model_path(model)
    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    from transformers import GgufConfig

    stored = _reference_file(path, dtype)
    if stored.exists():
        try:
            model = torch.load(stored, mmap=True, weights_only=False).eval()
            os.utime(stored)  # most recently used: the last to be evicted
            return model
        except Exception as e:  # a truncated or foreign file: read the GGUF again, and overwrite it
            logger.warning("ignoring an unreadable reference model %s: %s", stored, e)
    start = time.perf_counter()
    folder, filename = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    ).eval()
    if time.perf_counter() - start >= MIN_READ_SECONDS:
        _store(stored, model)
    return model


MIN_READ_SECONDS = 5.0
KEEP = 6
_SAMPLE = 4 << 20  # the bytes read at each end of a file for its key (`_reference_file`)


def _reference_file(path: str, dtype: torch.dtype) -> Path:
    """Where transformers' reading of a GGUF file is kept: its Python dequantization takes 30-80 s for a
    0.5B model (every test module and `llmserve eval --reference` would pay it again), mapping the result
    takes about a second. Keyed by the file's content (its size and a digest of its first and last
    `_SAMPLE` bytes: the header, the metadata and the last tensors; not its path or modification time, which
    every fresh install of a model package changes), the dtype and the versions of transformers and torch:
    the same reading, not a copy of ours."""
    import transformers

    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE))
        f.seek(max(size - _SAMPLE, 0))
        digest.update(f.read(_SAMPLE))
    parts = [size, digest.hexdigest(), str(dtype), transformers.__version__, torch.__version__]
    return cache_root() / "reference" / f"{hashlib.sha256(repr(parts).encode()).hexdigest()[:32]}.pt"


def _store(path: Path, model) -> None:
    """Writes the model (the whole module: a GGUF-read one refuses `save_pretrained`) and keeps the `KEEP` most
    recently used; one that cannot be written costs the next reading its time only."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model, tmp)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - a full disk, or a module that does not pickle
        tmp.unlink(missing_ok=True)
        logger.warning("could not keep the reference model: %s", e)
        return
    stored = sorted(path.parent.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in stored[KEEP:]:
        old.unlink(missing_ok=True)


def quantized_reference(model, method: str, grids: dict[str, dict[str, tuple[torch.Tensor, ...]]] | None = None):
    """A copy of a transformers Llama model whose linear weights are exactly the values llmserve's
    `--quantization method` computes with (the output head int8, its own copy where it was tied to the
    embedding). `grids`: the checkpoint's own grids by format (`Checkpoint.grids`), which each format keeps (see
    quantization/weight_only.py)."""
    import copy

    from torch import nn

    from llmserve.quantization.weight_only import WeightOnlyLinear, head_grid, layer_format

    ref = copy.deepcopy(model)
    grids = grids or {}
    with torch.no_grad():
        for name, module in ref.model.layers.named_modules(prefix="model.layers"):
            if isinstance(module, nn.Linear):
                layer_method, grid = layer_format(method, [f"{name}.weight"], grids)
                module.weight.copy_(WeightOnlyLinear(module.weight, layer_method, grid=grid).weight)
        head_source = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
        # the embedding, where they are tied
        head = WeightOnlyLinear(ref.lm_head.weight, "int8", grid=head_grid("int8", grids, head_source)).weight
        ref.lm_head.weight = nn.Parameter(head.clone())
    return ref


def int8_activation_reference(model, served: torch.nn.Module, method: str, max_tokens: int | None = None):
    """A copy of a transformers Llama model that computes every decoder projection as `served` (our
    model, after `--quantization method --int8-activations` calibrated it) does: inputs of more than
    `max_tokens` rows through the served int8 x int8 layer, fewer through the `method` quantized weight.
    None: the served layers' own limit."""
    ref = quantized_reference(model, method)
    for layer, ours in zip(ref.model.layers, served.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv, inter = ours.self_attn.q_size, ours.self_attn.kv_size, ours.mlp.intermediate_size
        for owner, name, fused, cols in (
            (attn, "q_proj", ours.self_attn.qkv_proj, slice(0, q)),
            (attn, "k_proj", ours.self_attn.qkv_proj, slice(q, q + kv)),
            (attn, "v_proj", ours.self_attn.qkv_proj, slice(q + kv, q + 2 * kv)),
            (attn, "o_proj", ours.self_attn.o_proj, slice(None)),
            (mlp, "gate_proj", ours.mlp.gate_up_proj, slice(0, inter)),
            (mlp, "up_proj", ours.mlp.gate_up_proj, slice(inter, 2 * inter)),
            (mlp, "down_proj", ours.mlp.down_proj, slice(None)),
        ):
            limit = fused.max_quantized_tokens if max_tokens is None else max_tokens
            setattr(owner, name, _ServedInt8Projection(getattr(owner, name), fused, cols, limit))
    return ref


class _ServedInt8Projection(torch.nn.Module):
    """One transformers projection computed through our fused layer's int8 x int8 path (its columns
    `cols`) above `limit` rows, through its own quantized weight at or below."""

    def __init__(self, dense: torch.nn.Linear, served: torch.nn.Module, cols: slice, limit: int) -> None:
        super().__init__()
        self.dense, self.served, self.cols, self.limit = dense, served, cols, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= self.limit:
            return self.dense(x)
        y = self.served.int8_forward(rows.to(self.served.smooth_inv.dtype))
        return y[:, self.cols].to(x.dtype).reshape(*x.shape[:-1], -1)


def q8_input_reference(model, method: str, grids: dict[str, dict[str, tuple[torch.Tensor, ...]]] | None = None,
                       max_tokens: int | None = None):
    """`quantized_reference`, each projection computed as llmserve's int4 and int8 kernels do under
    `q8_activations` in calls of at most `max_tokens` rows (default: Q8_MAX_TOKENS): the inputs at their Q8_0 levels
    (per group of 32: round(x / step) * step, step = max|x| / 127, float32 as the kernel rounds them) times q * scale
    (int4: plus the inputs as they are times the group minimums). Larger calls multiply the dense weight. The output
    head always takes the Q8_0 levels: llmserve computes it on the sampled rows alone, never more than a batch."""
    from torch import nn

    from llmserve.quantization.weight_only import Q8_MAX_TOKENS, layer_format

    ref = quantized_reference(model, method, grids)
    grids = grids or {}
    limit = Q8_MAX_TOKENS if max_tokens is None else max_tokens
    for name, module in list(ref.model.layers.named_modules(prefix="model.layers")):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                layer_method, grid = layer_format(method, [f"{name}.{child_name}.weight"], grids)
                setattr(module, child_name, _Q8InputProjection(child, layer_method, grid, limit))
    ref.lm_head = _Q8InputProjection(ref.lm_head, "int8", None, None)
    return ref


class _Q8InputProjection(torch.nn.Module):
    """One int4 or int8 projection on Q8_0 inputs (see `q8_input_reference`), at or below `limit` rows (None: any)."""

    def __init__(self, dense: torch.nn.Linear, method: str, grid, limit: int | None) -> None:
        from llmserve.quantization.methods.int4 import quantize_int4

        super().__init__()
        weight = dense.weight.detach().float()
        if method == "int4":
            q, scale, lo = quantize_int4(weight, grid)[:3]
            out_features, in_features = q.shape
            self.scaled = (q.float().view(out_features, -1, 32) * scale[..., None]).view(out_features, in_features)
            self.mins = lo.repeat_interleave(32, dim=1)
        else:  # the reference's weight already holds the int8 values, q * scale (or the file's 6-bit ones)
            self.scaled, self.mins = weight, None
        self.dense, self.limit = dense, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is not None and x.reshape(-1, x.shape[-1]).shape[0] > self.limit:
            return self.dense(x)
        y = torch.nn.functional.linear(q8_0_levels(x), self.scaled)
        if self.mins is not None:
            y = y + torch.nn.functional.linear(x.float(), self.mins)
        return (y if self.dense.bias is None else y + self.dense.bias).to(x.dtype)


def q8_0_levels(x: torch.Tensor) -> torch.Tensor:
    """x (float32) at its Q8_0 levels, rounded as llmserve's int4 kernel rounds them: per group of 32,
    round(x * (1 / step)) * step with step = max|x| / 127, all in float32."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    step = groups.abs().amax(dim=-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(groups * (1 / step)) * step).reshape(x.shape)


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int,
                     logit_bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding with transformers' KV cache and no logits processors (EOS is not special); `logit_bias` is
    added to every step's logits, as OpenAI's is."""
    out_ids: list[int] = []
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1].clone()
            if logit_bias:
                logits[list(logit_bias)] += torch.tensor(list(logit_bias.values()), dtype=logits.dtype,
                                                         device=device)
            token = int(logits.argmax())
            out_ids.append(token)
            out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return out_ids
