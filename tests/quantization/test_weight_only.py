"""Weight-only quantization: kernels agree with the dequantized weights, the Q4_1 model re-quantizes
to its shipped values, and the int4 engine's greedy tokens equal transformers run on the same
quantized weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmserve import LLM, SamplingParams
from llmserve.config import ModelConfig
from llmserve.evaluate.reference import q8_input_reference, quantized_reference, reference_greedy
from llmserve.kernels import native_quantized_kernels
from llmserve.loader import load_checkpoint
from llmserve.quantization.methods import LINEAR_METHODS
from llmserve.quantization.weight_only import Q8_MAX_TOKENS, WeightOnlyLinear
from tests.greedy import assert_greedy_equals


@pytest.mark.parametrize("native", [False, True], ids=["torch-kernels", "native-kernels"])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_dequantized_weight(method, dtype, native):
    if native and not native_quantized_kernels():
        pytest.skip("the native quantized kernels need AVX-512 VNNI or AVX2, which this CPU lacks")
    torch.manual_seed(0)
    weight = (torch.randn(96, 128) * 0.05).to(dtype)
    layer = WeightOnlyLinear(weight, method, native_kernels=native)
    assert layer.native == native
    x = torch.randn(LINEAR_METHODS[method].small_step_tokens, 128).to(dtype)
    kernel = layer(x)  # few tokens: the quantized kernel
    dense = nn.functional.linear(x, layer.weight)  # what a large step computes
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(kernel.float(), dense.float(), rtol=tol, atol=tol)
    # and the quantization error itself is what the format allows
    err = (layer.weight.float() - weight.float()).abs().max()
    assert 0 < err < (0.05 * 4 / 15 if method == "int4" else 0.05 * 4 / 127) + 1e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_native_and_torch_kernels_hold_the_same_quantized_values(method):
    if not native_quantized_kernels():
        pytest.skip("the native quantized kernels need AVX-512 VNNI or AVX2, which this CPU lacks")
    torch.manual_seed(1)
    weight = torch.randn(64, 96, dtype=torch.bfloat16) * 0.05
    native, fallback = (WeightOnlyLinear(weight, method, native_kernels=n) for n in (True, False))
    assert torch.equal(native.weight, fallback.weight)  # one quantization, two layouts
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    torch.testing.assert_close(native(x), fallback(x), rtol=2e-2, atol=2e-2)


def test_a_shape_the_native_kernel_does_not_take_keeps_the_torch_kernel():
    layer = WeightOnlyLinear(torch.randn(40, 64), "int8", native_kernels=True)  # 40 rows: not a multiple of 16
    assert not layer.native
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight), rtol=1e-4, atol=1e-4)


def test_large_steps_use_the_dequantized_weight():
    layer = WeightOnlyLinear(torch.randn(64, 64), "int4")
    x = torch.randn(LINEAR_METHODS["int4"].small_step_tokens + 1, 64)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight))


def test_q4_1_weights_requantize_to_their_shipped_values():
    # The embedded model is Q4_1: per group of 32, every weight is min + q * scale. Re-quantizing
    # the loader's dequantized weights must find the same grid (fp32 rounding aside).
    weight = load_checkpoint(None).weights["model.layers.0.mlp.down_proj.weight"].float()
    layer = WeightOnlyLinear(weight, "int4")
    scale = (weight.view(weight.shape[0], -1, 32).amax(-1) - weight.view(weight.shape[0], -1, 32).amin(-1)) / 15
    assert (layer.weight - weight).abs().max() < 1e-3 * scale.max()


def _a_qwen_tensor(type_name: str, read_grid) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The first tensor of Qwen2.5-Coder-0.5B's file stored as `type_name`: its dequantized weight and its grid as
    `read_grid` (the loader's) reads it; skips without the file or the native kernels."""
    from llmserve.loader.default_models import PARTED_MODELS, installed_path
    from llmserve.loader.gguf import _dense, read_tensors

    path = installed_path(PARTED_MODELS["qwen2.5-coder-0.5b"])
    if path is None or not native_quantized_kernels():
        pytest.skip("needs the Qwen2.5-Coder-0.5B file (make setup installs it) and the native kernels")
    tensor = next(t for t in read_tensors(path) if t.tensor_type.name == type_name)
    return _dense(tensor), tuple(torch.from_numpy(g.copy()) for g in read_grid(tensor))


def test_a_q4_k_layer_computes_with_the_file_s_values():
    """Qwen2.5-Coder-0.5B's Q4_K ffn_down: the int4 layer's weights are the file's values exactly (Q4_K's scales, an
    fp16 times a 6-bit integer, are not rounded to fp16), packed at 4.625 bits a weight, and the kernel's product on
    ~16-bit inputs is within that split's rounding of the file's (fp16 scales alone were ~6e-4 off)."""
    from llmserve.loader.gguf import int4_grid

    weight, grid = _a_qwen_tensor("Q4_K", int4_grid)
    layer = WeightOnlyLinear(weight, "int4", native_kernels=True, grid=grid)
    assert torch.equal(layer.weight, weight)
    assert layer.qweight.numel() == weight.numel() * 4.625 / 8
    x = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = x.double() @ weight.double().T
    assert (layer(x).double() - expected).abs().max() < 1e-4 * expected.abs().max()


# the file's types int8 keeps on their own grid: the layer's layout, its bits a weight, and how much further from the
# file's product the same weight re-quantized per row lands (at least)
INT8_FILE_GRIDS = {"Q6_K": ("six-bit", 6.625, 100), "Q5_0": ("grouped", 8.5, 10), "Q8_0": ("grouped", 8.5, 10)}


@pytest.mark.parametrize("type_name", list(INT8_FILE_GRIDS))
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.modes)])
def test_int8_layers_compute_with_the_file_s_values(type_name, dtype):
    """Qwen2.5-Coder-0.5B's Q6_K ffn_down, and its Q5_0 and Q8_0 tensors, on int8: the layer's weights are the file's
    values (not re-quantized per row), packed at 6.625 bits a weight (Q6_K's d and sc) or 8.5 (Q5_0's and Q8_0's d per
    32 inputs), its product on ~16-bit inputs within that split's rounding of the file's, also when the model's weight
    arrived rounded to bf16 (the levels are recovered from it), and without the native kernels (dense products of
    the same values); a grid that no longer gives the weight (a changed weight) is not used: that layer re-quantizes
    per row."""
    from llmserve.loader.gguf import int8_grid

    layout, bits, per_row_factor = INT8_FILE_GRIDS[type_name]
    weight, grid = _a_qwen_tensor(type_name, int8_grid)
    layer = WeightOnlyLinear(weight.to(dtype), "int8", native_kernels=True, grid=grid)
    assert layer.layout == layout and torch.equal(layer.weight, weight.to(dtype))
    assert layer.qweight.numel() == weight.numel() * bits / 8
    x = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = x.double() @ weight.double().T
    per_row = WeightOnlyLinear(weight, "int8", native_kernels=True)
    assert per_row.layout == "per row"
    error = (layer(x.to(dtype)).double() - expected).abs().max() / expected.abs().max()
    assert error < (1e-4 if dtype == torch.float32 else 2**-8)
    if dtype == torch.float32:  # re-quantized per row, the product was further from the file's
        assert (per_row(x).double() - expected).abs().max() > per_row_factor * error * expected.abs().max()
    if dtype == torch.float32:  # without the native kernels: the same values, every step on the dense product
        plain = WeightOnlyLinear(weight, "int8", native_kernels=False, grid=grid)
        assert plain.layout == layout and plain.qweight is None
        torch.testing.assert_close(plain(x), x @ weight.T)
    changed = weight.clone()
    changed[3, 5] += float(changed[3].abs().max()) / 7
    stale = WeightOnlyLinear(changed, "int8", native_kernels=True, grid=grid)
    assert stale.layout == "per row" and stale.qweight.numel() == weight.numel()


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError, match="CPU"):
        ModelConfig(quantization="int4", device="cuda")


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_int4_engine_matches_transformers_on_the_quantized_weights(hf_model, prompt_token_ids, compile):
    # the default kernels ("auto") are "native" wherever the native int4 kernels run (build_plan): asking
    # for them by name would run this same engine twice
    ref = quantized_reference(hf_model, "int4")
    expected = [reference_greedy(ref, ids, 32) for ids in prompt_token_ids]
    llm = LLM(dtype="float32", quantization="int4", compile=compile, kv_cache_memory_gb=0.25,
              max_model_len=2048)
    # where the native int4 products run, decode steps run the layers as one native call (kernels/decode_layer.cpp),
    # float32 included: int4 weights open the native elementwise ops to it
    assert (llm.engine.runner.fused_stack is not None) == native_quantized_kernels()
    # prompts prefill through the dequantized weights; 8 decodes a step, or one, through the int4 kernel
    assert_greedy_equals(llm, prompt_token_ids, expected, single=5)


def _greedy_with_logits(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding as `reference_greedy` does it, with each step's logits."""
    tokens, logits = [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


@pytest.mark.modes
@pytest.mark.skipif(not native_quantized_kernels(), reason="Q8_0 inputs are the native int4 kernel's")
def test_q8_inputs_engine_matches_transformers_on_their_levels(hf_model, prompt_token_ids):
    """q8_activations: decodes through the int4 kernel on their inputs' Q8_0 levels, prompts (longer than
    Q8_MAX_TOKENS, in one step) through the dequantized weights, batched and alone. Against transformers computing
    each int4 projection the same way: Q8_0 levels turn last-bit differences of float32 sums done in another order
    (the native RMSNorm and attention, a prompt's GEMM in a batch of another size) into whole-level ones (a level
    is ~0.8 % of its group's largest input), so the tokens must agree up to a step where the engine's token was
    within 5 % of the reference's best logit (measured on a Zen 5 host: the earliest such step came at the 7th
    token, 1.8 % below; other hosts' GEMMs round prompts otherwise), and many tokens must agree outright."""
    prompts = [ids for ids in prompt_token_ids if len(ids) > Q8_MAX_TOKENS]
    # the file's own grid (Q4_1): the kernel multiplies the Q8_0 levels by q * scale and the exact inputs by the
    # minimums, so the reference splits each weight as the file does
    ref = q8_input_reference(hf_model, "int4", load_checkpoint(None).grids)
    references = [_greedy_with_logits(ref, ids, 32) for ids in prompts]
    llm = LLM(dtype="float32", quantization="int4", q8_activations=True, large_steps="dense", kv_cache_memory_gb=0.25,
              max_model_len=2048, long_prefill_token_threshold=512, max_num_batched_tokens=4096)
    assert llm.engine.plan.activation_parts == 1 and llm.engine.runner.fused_stack is not None
    int4 = [m for m in llm.engine.runner.model.layers.modules() if isinstance(m, WeightOnlyLinear)]
    assert int4 and all(m.activation_parts == 1 and m.max_quantized_tokens == Q8_MAX_TOKENS for m in int4)
    head = llm.engine.runner.model.lm_head  # int8, its inputs as Q8_0 too (the reference's head takes their levels)
    assert (head.method, head.activation_parts, head.max_quantized_tokens) == ("int8", 1, Q8_MAX_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batched = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids for ids in prompts]
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    agreed = 0
    for got, (want, logits) in zip([*batched, *alone], [*references, *references], strict=True):
        diverged = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
        agreed += diverged
        if diverged < len(want):
            step = logits[diverged]
            assert step.max() - step[got[diverged]] < 0.05 * step.max().abs(), (diverged, got[diverged], want[diverged])
    assert agreed >= len(prompts) * 16  # and many agree outright: a quarter of the 2 x 32 a prompt (here: most)


@pytest.mark.modes
def test_int8_engine_matches_transformers_on_the_quantized_weights(hf_model, prompt_token_ids):
    """int8 weight-only end to end: prompts through the dequantized weights, decodes of up to 8 tokens a
    step through the int8 kernel, the output head int8."""
    ref = quantized_reference(hf_model, "int8")
    expected = [reference_greedy(ref, ids, 24) for ids in prompt_token_ids]
    llm = LLM(dtype="float32", quantization="int8", kv_cache_memory_gb=0.25, max_model_len=2048)
    assert llm.engine.plan.weights == "int8" and llm.engine.plan.small_step_max_tokens == 8
    assert_greedy_equals(llm, prompt_token_ids, expected, single=3)
