"""int8 weight-only checkpoints (per output channel, symmetric) in compressed-tensors' layout, read.

Why that layout: it is how vLLM and llm-compressor store int8 weights (`quant_method: compressed-tensors`,
format `int-quantized`): per linear `P`, `P.weight` int8 [out, in] and `P.weight_scale` float32 [out, 1],
w = q * scale, q in [-127, 127]. We read only the variant `llmserve quantize --method int8` writes
(quantization/export_int8.py): 8 bits, symmetric, one scale per channel, activations not quantized.
"""

from __future__ import annotations

import torch

INT8_FORMAT = "INT8"  # `Checkpoint.source_formats` value of a weight read from this layout
_WEIGHTS_SCHEME = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
                   "dynamic": False}
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": _WEIGHTS_SCHEME, "input_activations": None,
                                  "output_activations": None}},
    "ignore": ["lm_head"],
}


def read_int8_tensors(tensors: dict[str, torch.Tensor], quantization_config: dict
                      ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors with each int8 weight dequantized to float32 (q * scale), and those weights' names.
    Raises ValueError for a compressed-tensors scheme other than the one written above."""
    groups = quantization_config.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values()]
    if (quantization_config.get("format") != "int-quantized" or len(schemes) != 1
            or any(schemes[0].get(k) != v for k, v in _WEIGHTS_SCHEME.items() if k != "group_size")
            or any(g.get("input_activations") for g in groups.values())):
        raise ValueError("compressed-tensors checkpoints are read as int8 weights per channel, symmetric, without "
                         f"activation quantization (format int-quantized), not {quantization_config}")
    weights, quantized = {}, set()
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        scale = tensors.get(f"{name}_scale")
        if tensor.dtype == torch.int8:
            if scale is None:
                raise ValueError(f"int8 tensor {name} has no {name}_scale")
            weights[name] = tensor.float() * scale.float().view(-1, 1)
            quantized.add(name)
        else:
            weights[name] = tensor
    return weights, quantized
