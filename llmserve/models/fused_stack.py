"""The model's body (embedding, decoder layers, final norm) as one native call for decode-only steps
(kernels/decode_layer.cpp), built from a loaded model's layers.

The call interprets the model's description as the eager layers do: each field that differs from Llama's (norms
scaling by 1 + w, query/key norms, sandwich norms, the gate's activation, scaled embeddings, sliding windows, the
windowed layers' rotary table, experts with their router and a shared expert) is a named field of the stack or of
a layer.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.layers.moe import SparseMoE
from llmserve.quantization.weight_only import StackedLinear, WeightOnlyLinear


def fused_decode_stack(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """The model's body (embedding, decoder layers, final norm) as one native call for decode-only steps
    (kernels/decode_layer.cpp): at batch 1 the Python between a layer's ~11 kernels costs a good share of a step
    (docs/performance.md, "The one-call decode step"). Built from the embedding, the rotary tables, the layers' native
    int4 or int8 weights (a `StackedLinear`'s parts each), their large-step products for steps past the small-step
    kernels (int8 x int8, or dense on the quantized values: build it after `prepack_linears`, and again once
    calibration gives the layers int8 weights), q/k/v biases, norms, routers and KV caches (shared, not copied); it
    computes as the layers do on the native elementwise kernels, bit for bit, at any decode step's size. Raises
    ValueError where a layer's weights are not on the native kernels."""
    layers = list(model.layers)
    named = [named for layer in layers for named in _linears(layer)]
    if not all(isinstance(lin, WeightOnlyLinear | StackedLinear) and lin.native for _, lin, _ in named):
        raise ValueError("the fused decode stack needs every decoder linear on the native int4 or int8 kernels")
    if any(lin.bias is not None for name, lin, _ in named if name != "qkv"):
        raise ValueError("the fused decode stack takes a bias on q/k/v only")
    cfg = model.config
    sizes = {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
             "activation": _ACTIVATIONS[cfg.activation], "norm_unit_offset": int(cfg.norm_unit_offset)}
    if cfg.moe is not None:
        sizes.update(top_k=cfg.moe.top_k, normalize_top_k=int(cfg.moe.normalize_top_k))
    tensors = {"embedding": model.embed_tokens.weight, "cos_table": model.rotary.cos_cache,
               "sin_table": model.rotary.signed_sin_cache, "final_norm": model.norm.weight}
    if model.embed_scale is not None:
        tensors["embedding_scale"] = model.embed_scale
    if model.local_rotary is not None:
        local = model.local_rotary
        tensors.update(local_cos_table=local.cos_cache, local_sin_table=local.signed_sin_cache)
    stack = torch.classes.llmserve.DecodeStack(tensors, sizes,
                                               {"eps": cfg.rms_norm_eps, "scale": layers[0].self_attn.scale})
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        fields = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                  "k_cache": k_cache, "v_cache": v_cache}
        if attn.qkv_proj.bias is not None:
            fields["qkv_bias"] = attn.qkv_proj.bias
        if attn.q_norm is not None:
            fields.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight)
        if layer.sandwich:
            fields.update(pre_feedforward_norm=layer.pre_feedforward_layernorm.weight,
                          post_feedforward_norm=layer.post_feedforward_layernorm.weight)
        if isinstance(mlp, SparseMoE):
            fields["router"] = mlp.gate.weight
            if mlp.shared_expert is not None:
                fields["shared_expert_gate"] = mlp.shared_expert_gate.weight
        stack.add_layer(fields, {"window": attn.window, "rope": attn.rope})
        for name, linear, extra in _linears(layer):
            for part in linear.parts if isinstance(linear, StackedLinear) else [linear]:
                tensors, part_sizes = _part_fields(part)
                stack.add_part(name, tensors, {**part_sizes, **extra})
    stack.finish()
    return stack


def _linears(layer: nn.Module) -> list[tuple[str, nn.Module, dict[str, int]]]:
    """A layer's linears in the order the stack takes them, each with its name there (decode_layer.cpp, `add_part`)
    and what else it says of it (an expert's index)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [("qkv", attn.qkv_proj, {}), ("o", attn.o_proj, {})]
    if not isinstance(mlp, SparseMoE):
        return [*linears, ("gate_up", mlp.gate_up_proj, {}), ("down", mlp.down_proj, {})]
    for index, expert in enumerate(mlp.experts):
        linears += [("expert_gate_up", expert.gate_up_proj, {"expert": index}),
                    ("expert_down", expert.down_proj, {"expert": index})]
    if mlp.shared_expert is not None:
        linears += [("shared_gate_up", mlp.shared_expert.gate_up_proj, {}),
                    ("shared_down", mlp.shared_expert.down_proj, {})]
    return linears


def _part_fields(part: WeightOnlyLinear) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """One run of a linear's rows as the stack names it (decode_layer.cpp, `add_part`): its small-step weight and
    scales, its large-step product's tensors, and its sizes."""
    tensors = {"weight": part.qweight}
    if part.scales is not None:
        tensors["scales"] = part.scales
    tensors.update({name: t for name, t in zip(("smooth_inv", "large_weight", "large_scales", "large_extra"),
                                               _large_step_tensors(part), strict=True) if t is not None})
    return tensors, {"rows": part.out_features, "activation_parts": part.activation_parts,
                     "small_max_tokens": part.max_quantized_tokens,
                     "large_kind": _LARGE_STEP_KINDS[part.large_step_kernel]}


# a part's large-step product, as the stack names it (decode_layer.cpp, `LargeStepKind`)
_LARGE_STEP_KINDS = {"dense": 0, "onednn": 1, "amx": 2, "none": 3}
# the gate's activation (`ModelConfig.activation`), as the stack names it (decode_layer.cpp, `Activation`)
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def _large_step_tensors(part: WeightOnlyLinear) -> tuple[torch.Tensor | None, ...]:
    """What the stack's large-step product reads: smooth_inv, the weight, its scales, and zero points (oneDNN's)
    or compensation (the AMX kernel's); for the dense product only the weight, oneDNN's packed copy where it has one
    (the plain one may be released); none where the small-step kernel takes every step."""
    if part.large_step_kernel == "none":
        return None, None, None, None
    if part.large_step_kernel == "amx":
        return part.smooth_inv, part.int8_amx_packed, part.int8_scales, part.int8_compensation
    if part.large_step_kernel == "onednn":
        return part.smooth_inv, part.int8_packed, part.int8_scales, part.int8_zeros
    return None, part.packed if part.packed is not None else part.weight, None, None


