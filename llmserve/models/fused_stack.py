"""The model's body (embedding, decoder layers, final norm) as one native call for decode-only steps
(kernels/decode_layer.cpp), built from a loaded model's layers.

The native stack computes Llama's layer (RMSNorm, q/k/v with optional biases, rotary, full attention, a SiLU gate):
a model whose description holds more (`ModelConfig.beyond_llama`) runs its decode steps layer by layer, and the
build plan says why (`fused_stack_refusal`).
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.models.config import ModelConfig
from llmserve.quantization.weight_only import StackedLinear, WeightOnlyLinear


def fused_stack_refusal(cfg: ModelConfig) -> str | None:
    """Why the one native call cannot run this model, or None where it can."""
    extras = cfg.beyond_llama
    return f"the one native call runs Llama-shaped layers; this model has {', '.join(extras)}" if extras else None


def fused_decode_stack(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """The model's body (embedding, decoder layers, final norm) as one native call for decode-only steps
    (kernels/decode_layer.cpp): at batch 1 the Python between a layer's ~11 kernels costs a good share of a step
    (docs/performance.md, "The one-call decode step"). Built from the embedding, the rotary tables, the layers' native
    int4 or int8 weights (a `StackedLinear`'s parts each), their large-step products for steps past the small-step
    kernels (int8 x int8, or dense on the quantized values: build it after `prepack_linears`, and again once
    calibration gives the layers int8 weights), q/k/v biases, norms and KV caches (shared, not copied); it
    computes as the layers do, bit for bit, at any decode step's size. Raises ValueError where a layer's weights
    are not on the native kernels."""
    layers = list(model.layers)
    linears = [lin for layer in layers for lin in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if not all(isinstance(lin, WeightOnlyLinear | StackedLinear) and lin.native for lin in linears):
        raise ValueError("the fused decode stack needs every decoder linear on the native int4 or int8 kernels")
    if any(lin.bias is not None for layer in layers for lin in (layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                                                 layer.mlp.down_proj)):
        raise ValueError("the fused decode stack takes a bias on q/k/v only")
    parts = [list(lin.parts) if isinstance(lin, StackedLinear) else [lin] for lin in linears]
    flat = [part for each in parts for part in each]
    none = torch.empty(0)
    cfg = model.config
    return torch.classes.llmserve.DecodeStack(
        [layer.input_layernorm.weight for layer in layers],
        [layer.post_attention_layernorm.weight for layer in layers],
        [part.qweight for part in flat],
        [part.scales if part.method == "int8" else none for part in flat],
        [none if layer.self_attn.qkv_proj.bias is None else layer.self_attn.qkv_proj.bias for layer in layers],
        [k for k, _ in kv_caches], [v for _, v in kv_caches],
        cfg.num_heads, cfg.intermediate_size, cfg.rms_norm_eps, layers[0].self_attn.scale,
        [part.activation_parts for part in flat], [len(each) for each in parts], [part.out_features for part in flat],
        [part.max_quantized_tokens for part in flat],
        [_LARGE_STEP_KINDS[part.large_step_kernel] for part in flat],
        [t if t is not None else none for part in flat for t in _large_step_tensors(part)],
        model.embed_tokens.weight, model.rotary.cos_cache, model.rotary.signed_sin_cache, model.norm.weight,
    )


# a part's large-step product, as the stack names it (decode_layer.cpp, `LargeStepKind`)
_LARGE_STEP_KINDS = {"dense": 0, "onednn": 1, "amx": 2}


def _large_step_tensors(part: WeightOnlyLinear) -> tuple[torch.Tensor | None, ...]:
    """What the stack's large-step product reads: smooth_inv, the weight, its scales, and zero points (oneDNN's)
    or compensation (the AMX kernel's); for the dense product only the weight, oneDNN's packed copy where it has one
    (the plain one may be released)."""
    if part.large_step_kernel == "amx":
        return part.smooth_inv, part.int8_amx_packed, part.int8_scales, part.int8_compensation
    if part.large_step_kernel == "onednn":
        return part.smooth_inv, part.int8_packed, part.int8_scales, part.int8_zeros
    return None, part.packed if part.packed is not None else part.weight, None, None


