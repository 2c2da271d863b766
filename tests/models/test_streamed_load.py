"""A quantized model is quantized layer by layer as it loads: the dense weights of the whole model never exist."""

from __future__ import annotations

import torch

from llmserve import LLM
from llmserve.kernels import native_quantized_kernels
from llmserve.loader import build_model, load_checkpoint
from llmserve.quantization.weight_only import ModelQuantizer, WeightOnlyLinear


def test_each_layer_is_quantized_before_the_next_loads():
    """`build_model`'s `on_layer_loaded`: layer i is handed over complete (its weights equal the file's) before any
    of layer i + 1's are read, and a quantizer replacing its linears then leaves the next layers dense, not yet
    loaded; the result computes what quantizing the loaded model does."""
    ckpt = load_checkpoint(None)
    seen: list[int] = []

    def on_layer_loaded(model, index):
        layer = model.layers[index]
        assert seen == list(range(index))  # in order, once each
        assert not any(isinstance(m, WeightOnlyLinear) for m in model.layers[index].modules())
        if index + 1 < len(model.layers):  # the next layer is untouched: its linears still the dense ones
            assert not any(isinstance(m, WeightOnlyLinear) for m in model.layers[index + 1].modules())
        quantizer.layer(model, index)
        assert any(isinstance(m, WeightOnlyLinear) for m in layer.modules())
        seen.append(index)

    quantizer = ModelQuantizer("int4", grids=ckpt.grids)
    streamed = build_model(ckpt, torch.float32, "cpu", on_layer_loaded=on_layer_loaded)
    quantizer.output_head(streamed)
    assert seen == list(range(streamed.config.num_layers)) and not ckpt.weights  # every tensor taken

    whole = ModelQuantizer("int4", grids=load_checkpoint(None).grids)(
        build_model(load_checkpoint(None), torch.float32, "cpu"))
    x = torch.randn(5, streamed.config.hidden_size)
    for a, b in zip(streamed.layers, whole.layers, strict=True):
        assert torch.equal(a.mlp.gate_up_proj(x), b.mlp.gate_up_proj(x))
    assert torch.equal(streamed.lm_head(x), whole.lm_head(x))


def test_the_served_model_keeps_no_dense_copy_of_its_quantized_weights():
    """The default (every step on the quantized kernels, where they run): no layer holds its dequantized weight, or
    an int8 or oneDNN copy of it; and the checkpoint's grids were let go once used."""
    llm = LLM(kv_cache_memory_gb=0.05, large_steps="quantized" if native_quantized_kernels() else "auto")
    runner = llm.engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, WeightOnlyLinear)]
    assert layers and runner.model.lm_head in layers
    if llm.engine.plan.large_steps == "quantized":
        assert all(m.weight is None and m.packed is None and m.int8_weight is None and m.int8_amx_packed is None
                   for m in layers)
        assert {m.large_step_kernel for m in layers} == {"none"}
