"""A checkpoint's decoder linears put on int4 groups (AWQ, GPTQ, or round to nearest), as a checkpoint again.

Why a checkpoint in, a checkpoint out: the result is plain data the rest already takes. The dequantized
values replace the weights, their per-32 grids go to `int4_grids` (which the int4 path keeps, as it keeps
a GGUF's own 4-bit grid), the AWQ scales are folded into the norms and linears, and the groups themselves
stay in `int4_groups` for `llmserve quantize` to write. So `--quantization awq` is this step before the
usual int4 build, and a checkpoint written from it loads to the same values.

The starting point is the checkpoint's dense weights, whatever the file: a GGUF's are its dequantized
values, and its own 4-bit grid (`int4_grids`) is set aside, so AWQ, GPTQ and round to nearest start from the
same weights and differ only by their method.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from llmserve.loader.awq_format import AWQ_FORMAT
from llmserve.loader.checkpoint import Checkpoint
from llmserve.loader.gptq_format import GPTQ_FORMAT
from llmserve.quantization.awq import AWQConfig, AWQResult, awq_quantize, calibration_samples
from llmserve.quantization.gptq import GPTQConfig, gptq_quantize
from llmserve.quantization.int4_groups import Int4Groups, fit_groups

logger = logging.getLogger(__name__)

INT4_GROUP_METHODS = ("awq", "gptq", "int4")
# `--quantization awq` at start: groups of 32, our kernels' own (128 takes the same bytes in them and is
# only coarser; it is for files, `llmserve quantize --group-size`)
SERVE_AWQ_GROUP_SIZE = 32  # activation-aware scales, or round to nearest on the same groups
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_decoder_linear(name: str) -> bool:
    """Whether a Hugging Face tensor name is a decoder layer's linear weight (what int4 quantizes)."""
    return ".layers." in f".{name}" and name.endswith(tuple(f".{p}.weight" for p in _DECODER_LINEARS))


def quantize_checkpoint(ckpt: Checkpoint, method: str, config: AWQConfig | GPTQConfig,
                        calibration: str | None = None) -> tuple[Checkpoint, AWQResult | None]:
    """The checkpoint with every decoder linear on int4 groups of `config.group_size`: "awq" searches and
    folds scales on the calibration text first, "gptq" rounds column by column against the calibration inputs
    (`config` a `GPTQConfig`), "int4" rounds to nearest. `ckpt` is consumed (its weights move into the result).
    A checkpoint already on groups (an AWQ or GPTQ directory) comes back as it is. `calibration`: the text the
    calibrated methods read (default: quantization/calibration.txt). Returns the AWQ search's record too (None for
    the others or nothing done)."""
    if method not in INT4_GROUP_METHODS:
        raise ValueError(f"int4 group quantization is one of {list(INT4_GROUP_METHODS)}, got {method!r}")
    if (method == "gptq") != isinstance(config, GPTQConfig):
        raise ValueError(f"{method} takes a {'GPTQConfig' if method == 'gptq' else 'AWQConfig'}, got {config!r}")
    if ckpt.int4_groups:
        logger.info("%s is on int4 groups already (group size %d): used as stored", ckpt.name,
                    next(iter(ckpt.int4_groups.values())).group_size)
        return ckpt, None
    dtypes = {name: t.dtype for name, t in ckpt.weights.items()}
    result = None
    if method == "int4":
        groups = {name: fit_groups(w, config.group_size) for name, w in ckpt.weights.items() if is_decoder_linear(name)}
        weights = ckpt.weights
    elif method == "gptq":
        weights, groups = _calibrated(ckpt, config.max_seq_len, calibration, lambda model, samples: gptq_quantize(
            model, samples, config))
    else:
        def awq(model: nn.Module, samples: list[torch.Tensor]) -> dict[str, Int4Groups]:
            nonlocal result
            result = awq_quantize(model, samples, config, quantize=False)
            return result.groups

        weights, groups = _calibrated(ckpt, config.max_seq_len, calibration, awq)
    for name, g in groups.items():
        weights[name] = g.dequantize()
    for name, tensor in weights.items():  # the rest as stored (a folded norm rounded to its file's dtype)
        if name not in groups and tensor.dtype != dtypes[name]:
            weights[name] = tensor.to(dtypes[name])
    stored_as = GPTQ_FORMAT if method == "gptq" else AWQ_FORMAT
    formats = {name: stored_as if name in groups else (ckpt.source_formats or {}).get(name, "dense")
               for name in weights}
    return dataclasses.replace(ckpt, weights=weights, source_formats=formats, int4_groups=groups,
                               int4_grids={name: g.grid32() for name, g in groups.items()}), result


def _calibrated(ckpt: Checkpoint, max_seq_len: int, calibration: str | None,
                method: Callable[[nn.Module, list[torch.Tensor]], dict[str, Int4Groups]]
                ) -> tuple[dict[str, torch.Tensor], dict[str, Int4Groups]]:
    """A calibrated method (AWQ, GPTQ) on our float32 model of the checkpoint (PyTorch ops), its parameters written
    back by their Hugging Face names, fused q/k/v and gate/up split into their parts again (a tied output head is the
    embedding's one tensor: written once). `method(model, samples)` changes the model in place and returns the
    groups by parameter name."""
    from llmserve.loader import build_model

    names = {k.removeprefix("model."): k for k in ckpt.weights}
    rows = {k.removeprefix("model."): t.shape[0] for k, t in ckpt.weights.items()}
    model = build_model(ckpt, torch.float32, "cpu")  # takes the tensors out of ckpt.weights
    found = method(model, calibration_samples(ckpt.tokenizer, max_seq_len, calibration))
    weights, groups = {}, {}
    for name, param in model.named_parameters():
        sources = model.checkpoint_sources(name)
        parts = param.detach().split([rows[s] for s in sources]) if len(sources) > 1 else [param.detach()]
        start = 0
        for source, part in zip(sources, parts, strict=True):
            weights[names[source]] = part.clone()
            if name in found:
                groups[names[source]] = found[name].rows(start, start + len(part))
            start += len(part)
    return weights, groups
