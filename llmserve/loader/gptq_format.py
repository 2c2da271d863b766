"""GPTQ's checkpoint layout (AutoGPTQ, GPTQModel, transformers): int4 weights packed along the inputs, read and written.

Why this layout: it is what GPTQ checkpoints on the Hugging Face hub ship in and what vLLM, SGLang, TGI and
transformers load as `quant_method: gptq`, so a checkpoint `llmserve quantize --method gptq` writes runs on them,
and theirs on us. Per quantized linear `P` (a Hugging Face name such as model.layers.0.mlp.down_proj):

    P.qweight  int32 [in / 8, out]        eight input rows per int32: row 8r + k in bits 4k..4k+3
    P.qzeros   int32 [groups, out / 8]    the zero points, eight output columns per int32 (same order)
    P.scales   fp16  [groups, out]
    P.g_idx    int32 [in]                 the group of each input

and w[o, i] = (q[o, i] - z[g_idx[i], o]) * s[g_idx[i], o]. `checkpoint_format: gptq` (v1, the common one) stores
z - 1 (AutoGPTQ's kernels add the one back, without masking: a stored 15 is a zero point of 16); `gptq_v2`
(GPTQModel's) stores z. Act-order checkpoints (`desc_act`) may shuffle the groups (g_idx not i // group size);
those need the inputs permuted before the product, which our int4 layers do not do, so they are refused by
name. Act order with static groups (`llmserve quantize --method gptq --act-order`) keeps g_idx = i // group size.
"""

from __future__ import annotations

import torch

from llmserve.quantization.int4_groups import Int4Groups, check_group_size, read_packed_linears, stored_groups

GPTQ_FORMAT = "GPTQ"  # `Checkpoint.source_formats` value of a weight read from this layout
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def pack_gptq(groups: Int4Groups, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales", "g_idx"} of one linear's groups (contiguous: g_idx = i // group size).
    v1 ("gptq") stores z - 1, which needs every zero point in [1, 15]: ValueError otherwise (write gptq_v2)."""
    _check_format(checkpoint_format)
    stored = groups.zeros - 1 if checkpoint_format == "gptq" else groups.zeros
    if stored.min() < 0 or stored.max() > 15:
        raise ValueError(f"{checkpoint_format} zero points are stored in 4 bits as "
                         f"{'z - 1' if checkpoint_format == 'gptq' else 'z'}; these have z in "
                         f"[{groups.zeros.min().item()}, {groups.zeros.max().item()}] (write gptq_v2)")
    in_features = groups.q.shape[1]
    return {"qweight": _pack_rows(groups.q.t()), "qzeros": _pack_rows(stored).t().contiguous(),
            "scales": groups.scales.t().contiguous().to(torch.float16),
            "g_idx": (torch.arange(in_features) // groups.group_size).to(torch.int32)}


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                group_size: int, checkpoint_format: str = "gptq") -> Int4Groups:
    """The groups of one linear from its tensors (`pack_gptq`'s inverse). ValueError for shuffled groups."""
    _check_format(checkpoint_format)
    q = _unpack_rows(qweight).t().contiguous()  # [out, in]
    check_group_size(group_size, q.shape[1])
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(q.shape[1]) // group_size):
        raise ValueError("this GPTQ checkpoint's groups are shuffled (act order without static groups: g_idx is not "
                         "i // group_size); llmserve's int4 kernels take groups of contiguous inputs. Quantize the "
                         "model again with `llmserve quantize --method gptq --act-order` (static groups)")
    zeros = _unpack_rows(qzeros.t().contiguous()).contiguous()  # [out, groups]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    return stored_groups(q, zeros, scales, group_size, "GPTQ", f"qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}")


def read_gptq_tensors(tensors: dict[str, torch.Tensor], quantization_config: dict
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Int4Groups]]:
    """A checkpoint's tensors with each packed linear replaced by its dequantized float32 `.weight`, and the
    groups by that weight's name. Raises ValueError for a GPTQ variant we do not read."""
    bits = quantization_config.get("bits", 4)
    checkpoint_format = str(quantization_config.get("checkpoint_format", "gptq")).lower()
    group_size = int(quantization_config.get("group_size", 128))
    if bits != 4 or group_size == -1:
        raise ValueError(f"GPTQ checkpoints are read with 4 bits in groups (a multiple of 32 inputs), not bits={bits}, "
                         f"group_size={group_size}")
    return read_packed_linears(tensors, "GPTQ", (".g_idx",), lambda prefix: unpack_gptq(
        tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
        tensors.get(f"{prefix}.g_idx"), group_size, checkpoint_format))


def quantization_config(group_size: int, sym: bool, act_order: bool, damp_percent: float) -> dict:
    """The `quantization_config` (and quantize_config.json) of a checkpoint we write. Symmetric groups are v1,
    which every GPTQ reader takes (vLLM's Marlin kernels take symmetric ones only); asymmetric ones gptq_v2,
    as GPTQModel writes them (v1 cannot store a zero point of 0)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
            "static_groups": act_order, "sym": sym, "true_sequential": True, "damp_percent": damp_percent,
            "checkpoint_format": "gptq" if sym else "gptq_v2"}


def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format is one of {list(CHECKPOINT_FORMATS)}, got {checkpoint_format!r}")


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] integers in [0, 15] -> int32 [rows / 8, cols], row 8r + k in bits 4k (AutoGPTQ's `pack`)."""
    rows, cols = values.shape
    if rows % 8:
        raise ValueError(f"GPTQ packs 8 rows to an int32; {rows} rows do not divide")
    nibbles = values.to(torch.int64).view(rows // 8, 8, cols)
    packed = (nibbles << _SHIFTS.view(1, 8, 1)).sum(dim=1)  # < 2^32: as the int32 with those bits
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [n, cols] -> int32 [8 n, cols] (`_pack_rows`' inverse)."""
    nibbles = (packed.to(torch.int64).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 15  # [n, 8, cols]
    return nibbles.reshape(-1, packed.shape[1]).to(torch.int32)
