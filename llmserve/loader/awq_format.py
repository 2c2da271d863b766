"""AutoAWQ's "GEMM" checkpoint layout: int4 weights packed eight to an int32, read and written.

Why this layout: it is what AutoAWQ writes and what vLLM, transformers and TGI load as
`quant_method: awq, version: gemm`, so a checkpoint `llmserve quantize` writes runs on them, and theirs on us.
Per quantized linear `P` (a Hugging Face name such as model.layers.0.mlp.down_proj), beside its bias:

    P.qweight  int32 [in, out / 8]       q transposed, eight output columns per int32
    P.qzeros   int32 [in / g, out / 8]   the zero points, packed alike
    P.scales   fp16  [in / g, out]

and w[o, i] = (q[o, i] - z[o, i // g]) * s[o, i // g]. In each int32, nibble k (bits 4k..4k+3) holds output
column 8c + AWQ_ORDER[k] (AutoAWQ's `WQLinear_GEMM.from_linear`; the order its CUDA kernel reads).
"""

from __future__ import annotations

import torch

from llmserve.quantization.int4_groups import Int4Groups, read_packed_linears, stored_groups

AWQ_FORMAT = "AWQ"  # `Checkpoint.source_formats` value of a weight read from this layout
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def pack_awq(groups: Int4Groups) -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales"} of one linear's groups."""
    return {"qweight": _pack_columns(groups.q.t()), "qzeros": _pack_columns(groups.zeros.t()),
            "scales": groups.scales.t().contiguous().to(torch.float16)}


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Groups:
    """The groups of one linear from its three tensors (`pack_awq`'s inverse)."""
    q, zeros = _unpack_columns(qweight).t().contiguous(), _unpack_columns(qzeros).t().contiguous()
    return stored_groups(q, zeros, scales, group_size, "AWQ", f"qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}")


def read_awq_tensors(tensors: dict[str, torch.Tensor], quantization_config: dict
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Int4Groups]]:
    """A checkpoint's tensors with each packed linear replaced by its dequantized float32 `.weight`, and the
    groups by that weight's name. Raises ValueError for an AWQ variant we do not read."""
    bits, version = quantization_config.get("bits", 4), str(quantization_config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not quantization_config.get("zero_point", True):
        raise ValueError(f"AWQ checkpoints are read in their 4-bit GEMM layout with zero points, not "
                         f"bits={bits}, version={version!r}, zero_point={quantization_config.get('zero_point')}")
    group_size = int(quantization_config.get("group_size", 128))
    return read_packed_linears(tensors, "AWQ", (), lambda prefix: unpack_awq(
        tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"], group_size))


def _pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] integers in [0, 15] -> int32 [rows, cols / 8] in AWQ's nibble order."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 columns to an int32; {cols} columns do not divide")
    nibbles = values.to(torch.int64).view(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    packed = (nibbles << _SHIFTS).sum(dim=-1)  # < 2^32: as the int32 with those bits
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, n] -> int32 [rows, 8 n] (`_pack_columns`' inverse)."""
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> _SHIFTS) & 15  # [rows, n, 8] in bit order
    columns = torch.empty_like(nibbles)
    columns[:, :, list(AWQ_ORDER)] = nibbles
    return columns.view(packed.shape[0], -1).to(torch.int32)
