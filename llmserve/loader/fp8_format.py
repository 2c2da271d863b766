"""FP8 (e4m3) weight checkpoints as vLLM, llm-compressor and DeepSeek write them, read.

Why these: they are the FP8 checkpoints published today. Each linear `P` is `P.weight` float8_e4m3fn [out, in] and a
float32 scale, w = q * scale:
- `quant_method: fp8` (vLLM, AutoFP8): `P.weight_scale` per tensor ([] or [1]) or per output channel ([out] or
  [out, 1]); with `weight_block_size: [128, 128]` (DeepSeek-V3) `P.weight_scale_inv` [ceil(out / 128), ceil(in / 128)],
  one scale per block of 128 x 128 (a partial block at the edges).
- `quant_method: compressed-tensors`, format `float-quantized` (llm-compressor's FP8 schemes): `P.weight_scale`,
  strategy tensor, channel or block (`block_structure`).
Weights only: dynamic activation quantization is ignored (our products take the activations as they are) and its
scales dropped; static activation quantization is refused, as are e5m2 weights and other block widths than 128.

The weights arrive dequantized (float32, q * scale, which is how compressed-tensors' `dequantize` computes them), with
each one's scales as a grid the fp8 layers keep (`Checkpoint.fp8_grids`): float32 [out, ceil(in / 128)], one per row
and block of 128 inputs (a per-tensor or per-channel scale repeated), so that fused q/k/v rows and tensor-parallel
cuts slice it as they slice the weight.
"""

from __future__ import annotations

import torch

from llmserve.kernels.fp8_gemv import FP8_BLOCK, fp8_blocks

FP8_FORMAT = "FP8"  # `Checkpoint.source_formats` value of a weight read from these layouts
_ACTIVATION_SCALES = (".input_scale", ".k_scale", ".v_scale", ".output_scale")


def is_fp8_config(quantization_config: dict) -> bool:
    """Whether a config.json's `quantization_config` describes FP8 weights (either layout above)."""
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return True
    if method != "compressed-tensors":
        return False
    groups = (quantization_config.get("config_groups") or {}).values()
    formats = {quantization_config.get("format")} | {g.get("format") for g in groups}
    return "float-quantized" in formats or any((g.get("weights") or {}).get("type") == "float" for g in groups)


def _block_rows(quantization_config: dict) -> int | None:
    """Rows per scale block (None: per tensor or per channel), after checking the scheme is one we read."""
    if quantization_config.get("quant_method") == "fp8":
        if quantization_config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 checkpoints are read with dynamic (unquantized) activations, not activation_scheme "
                             f"{quantization_config.get('activation_scheme')!r}: static activation scales are not "
                             "supported")
        if quantization_config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 weights are read as e4m3, not {quantization_config.get('fmt')!r}")
        block = quantization_config.get("weight_block_size")
        return _checked_block(block) if block else None
    blocks = set()
    for name, group in (quantization_config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if (weights.get("type") != "float" or weights.get("num_bits") != 8 or not weights.get("symmetric", True)
                or weights.get("dynamic") or weights.get("strategy") not in ("tensor", "channel", "block")):
            raise ValueError(f"compressed-tensors float-quantized checkpoints are read as 8-bit float weights per "
                             f"tensor, channel or block, not {name}'s {weights}")
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic"):
            raise ValueError(f"{name} quantizes activations statically ({activations}): fp8 checkpoints are read "
                             "with dynamic (unquantized) activations only")
        if group.get("output_activations"):
            raise ValueError(f"{name} quantizes output activations: not supported")
        if weights["strategy"] == "block":
            blocks.add(_checked_block(weights.get("block_structure")))
    if len(blocks) > 1:
        raise ValueError(f"one block structure per checkpoint is read, got rows {sorted(blocks)}")
    return blocks.pop() if blocks else None


def _checked_block(block) -> int:
    if not isinstance(block, list | tuple) or len(block) != 2 or block[1] != FP8_BLOCK or block[0] < 1:
        raise ValueError(f"fp8 block scales are read for blocks of [rows, {FP8_BLOCK}] (DeepSeek's [128, 128]), "
                         f"got {block}")
    return int(block[0])


def read_fp8_tensors(tensors: dict[str, torch.Tensor], quantization_config: dict
                     ) -> tuple[dict[str, torch.Tensor], set[str], dict[str, tuple[torch.Tensor]]]:
    """The tensors with each fp8 weight dequantized to float32 (q * scale), those weights' names, and their grids
    (float32 [out, ceil(in / 128)]). Raises ValueError for a scheme other than those above, an fp8 weight without its
    scale, a scale whose weight is not e4m3, or a scale of the wrong shape."""
    block_rows = _block_rows(quantization_config)
    weights, quantized, grids = {}, set(), {}
    scale_names = {n for n in tensors if n.endswith((".weight_scale", ".weight_scale_inv"))}
    for name, tensor in tensors.items():
        if name in scale_names or name.endswith(_ACTIVATION_SCALES):
            continue
        scale = tensors.get(f"{name}_scale_inv", tensors.get(f"{name}_scale"))
        if tensor.dtype == torch.float8_e4m3fn:
            if scale is None:
                raise ValueError(f"fp8 tensor {name} has no {name}_scale_inv or {name}_scale")
            weights[name], grids[name] = dequantize_fp8(name, tensor, scale, block_rows)
            quantized.add(name)
        elif scale is not None:
            raise ValueError(f"{name} has a weight scale but is {str(tensor.dtype).removeprefix('torch.')}, not "
                             "float8_e4m3fn (fp8 weights are read as e4m3)")
        elif tensor.dtype == torch.float8_e5m2:
            raise ValueError(f"{name} is float8_e5m2: fp8 weights are read as e4m3")
        else:
            weights[name] = tensor
    return weights, quantized, grids


def dequantize_fp8(name: str, q: torch.Tensor, scale: torch.Tensor, block_rows: int | None
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
    """One weight's values q * scale in float32 and its grid (see the module's docstring)."""
    if q.dim() != 2:
        raise ValueError(f"fp8 tensor {name} must be [out, in], got {list(q.shape)}")
    if not scale.is_floating_point():
        raise ValueError(f"{name}'s scale must be floating point, got {scale.dtype}")
    out_features, in_features = q.shape
    blocks = fp8_blocks(in_features)
    s = scale.float()
    if block_rows is not None:
        expected = (-(-out_features // block_rows), blocks)
        if tuple(s.shape) != expected:
            raise ValueError(f"{name}'s block scales must be {list(expected)} for blocks of [{block_rows}, "
                             f"{FP8_BLOCK}], got {list(s.shape)}")
        rows = s.repeat_interleave(block_rows, dim=0)[:out_features]  # [out, blocks]
    elif s.numel() == 1:
        rows = s.reshape(1, 1).expand(out_features, blocks)
    elif tuple(s.shape) in ((out_features,), (out_features, 1)):
        rows = s.reshape(out_features, 1).expand(out_features, blocks)
    else:
        raise ValueError(f"{name}'s scale must be per tensor ([1]) or per output channel ([{out_features}, 1]), got "
                         f"{list(s.shape)}")
    values = q.float()
    if values.isnan().any():
        raise ValueError(f"fp8 tensor {name} holds NaN")
    grid = rows.contiguous()
    values = values * grid.repeat_interleave(FP8_BLOCK, dim=1)[:, :in_features]
    return values, (grid,)
