"""FP8 (e4m3) weights: the native kernel equals PyTorch's product of the same values on every loop, a checkpoint
`llmserve quantize --method fp8` writes is served at exactly the written bytes and scales (per channel, and in
128 x 128 blocks on shapes that are not multiples of 128), and greedy tokens equal transformers' on the same
dequantized weights: quantized in memory, and read from a written checkpoint by transformers itself.

Independent readers: transformers' compressed-tensors integration (`CompressedTensorsConfig(dequantize=True)`, which
decompresses float-quantized weights with compressed-tensors' `dequantize` on the CPU) reads the per-channel
checkpoints; transformers' fine-grained fp8 integration (which dequantizes on a CPU, `Fp8Dequantize`) reads the
128 x 128 block ones where every shape is a multiple of 128 (it refuses partial blocks); compressed-tensors'
`dequantize` checks partial blocks in tests/loader/test_fp8_format.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from llmserve import LLM, SamplingParams
from llmserve.cli import main as cli_main
from llmserve.evaluate.reference import quantized_reference, reference_greedy
from llmserve.host import cpu_flags
from llmserve.kernels import load_cpu_kernels, native_quantized_kernels
from llmserve.kernels.fp8_gemv import fp8_blocks, pack_fp8
from llmserve.loader import load_checkpoint
from llmserve.quantization.methods.fp8 import expand_blocks
from llmserve.quantization.weight_only import WeightOnlyLinear
from tests.greedy import assert_greedy_equals
from tests.quantization.tiny_models import make_tiny_hf_dir


def _case(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 bytes over their whole range, scales per row and 128 inputs, the dense values q * scale)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(out_features, in_features, generator=gen) * 80).clamp(-448, 448).to(torch.float8_e4m3fn)
    q.view(torch.uint8)[0, :6] = torch.tensor([0x00, 0x01, 0x07, 0x81, 0x7E, 0xFE], dtype=torch.uint8)  # subnormal, max
    scales = torch.rand(out_features, fp8_blocks(in_features), generator=gen) * 1e-3 + 1e-5
    return q, scales, q.float() * expand_blocks(scales, in_features)


@pytest.mark.parametrize("shape", [(48, 300), (64, 576), (32, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_equals_pytorch_on_the_same_values(shape, dtype):
    assert load_cpu_kernels(), "the native kernels must build here (setup builds them)"
    flags = cpu_flags()
    expected_path = "avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if "avx2" in flags else "portable"
    assert torch.ops.llmserve.fp8_gemv_path() == expected_path
    q, scales, dense = _case(*shape)
    packed = pack_fp8(q, scales)
    assert packed.numel() == q.numel() + 4 * scales.numel()  # one byte a weight, a float32 a row and 128 inputs
    gen = torch.Generator().manual_seed(1)
    for tokens in (1, 2, 3, 5, 8, 9, 17):  # every register count of a pass, and more than one pass
        x = torch.randn(tokens, shape[1], generator=gen).to(dtype)
        reference = nn.functional.linear(x.double(), dense.double())
        for op in (torch.ops.llmserve.fp8_gemv, torch.ops.llmserve.fp8_gemv_portable):
            y = op(x, packed, shape[0])
            assert y.dtype == dtype and y.shape == (tokens, shape[0])
            tol = 2e-6 if dtype == torch.float32 else 8e-3  # float32 sums; bf16: the output's rounding
            torch.testing.assert_close(y.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
        # a token's output has the same bits whatever else its step holds (the plan's determinism relies on it)
        y = torch.ops.llmserve.fp8_gemv(x, packed, shape[0])
        for row in range(tokens):
            assert torch.equal(torch.ops.llmserve.fp8_gemv(x[row:row + 1], packed, shape[0]), y[row:row + 1])


@pytest.mark.parametrize("native", [False, True], ids=["torch-kernels", "native-kernels"])
def test_layer_small_steps_equal_its_dense_product(native):
    if native and not native_quantized_kernels():
        pytest.skip("the native quantized kernels need AVX-512 VNNI or AVX2, which this CPU lacks")
    torch.manual_seed(0)
    weight = torch.randn(96, 200) * 0.05
    layer = WeightOnlyLinear(weight, "fp8", native_kernels=native)
    assert layer.layout == "e4m3 per channel" and (layer.qweight is not None) == native
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    assert torch.equal(layer.weight, (weight / scale).to(torch.float8_e4m3fn).float() * scale)
    x = torch.randn(layer.max_quantized_tokens, 200)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def _written(path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A written weight's e4m3 bytes and its scale as stored."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        scale_name = f"{name}_scale_inv" if f"{name}_scale_inv" in f.keys() else f"{name}_scale"
        return f.get_tensor(name), f.get_tensor(scale_name)


@pytest.mark.parametrize("block", [None, 128], ids=["per-channel", "blocks"])
def test_checkpoint_serves_exactly_the_written_bytes_and_scales(tmp_path, block):
    # 192 and 320 inputs, 96-row k and v: no shape a multiple of 128, so the blocks' edges are partial
    tiny = make_tiny_hf_dir(tmp_path / "tiny", "llama", kv_heads=2, hidden=192, intermediate=320)
    out = tmp_path / "fp8"
    args = ["quantize", str(tiny), "--method", "fp8", "--dtype", "float32", "--out", str(out)]
    assert cli_main(args + (["--fp8-block", "128"] if block else [])) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == ("fp8" if block else "compressed-tensors")
    q, scale = _written(out, "model.layers.0.mlp.down_proj.weight")
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == ((2, 3) if block else (192, 1))

    served = LLM(str(out), dtype="float32", kv_cache_memory_gb=0.05)
    assert served.engine.plan.weights == "fp8"  # auto: a file of only FP8 linear weights runs on fp8
    layers = served.engine.runner.model.layers
    for linear, parts in ((layers[1].self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                          (layers[0].mlp.gate_up_proj, ("gate_proj", "up_proj")), (layers[0].mlp.down_proj, ("",))):
        prefix = "model.layers.1.self_attn" if parts[0] == "q_proj" else "model.layers.0.mlp"
        names = [f"{prefix}.{p}.weight" if p else f"{prefix}.down_proj.weight" for p in parts]
        written = [_written(out, n) for n in names]
        rows = [(s.repeat_interleave(128, dim=0)[:q.shape[0]] if block else s.expand(q.shape[0], -1))
                for q, s in written]
        grid = torch.cat([r.expand(-1, fp8_blocks(q.shape[1])) for r, (q, _) in zip(rows, written, strict=True)])
        bytes_ = torch.cat([q for q, _ in written])
        values = bytes_.float() * expand_blocks(grid, bytes_.shape[1])
        assert linear.layout == "e4m3, the file's scales"
        if linear.native:
            assert torch.equal(linear.qweight, pack_fp8(bytes_, grid))  # the kernel's: the very bytes and scales
        x = torch.randn(linear.max_quantized_tokens + 3, bytes_.shape[1])  # a large step: the dense product
        torch.testing.assert_close(linear(x), nn.functional.linear(x, values), rtol=1e-5, atol=1e-5)
    ckpt = load_checkpoint(str(out))  # and the reading itself: q * scale, exactly
    q, scale = _written(out, "model.layers.1.self_attn.k_proj.weight")
    rows = scale.repeat_interleave(128, dim=0)[:96] if block else scale
    assert torch.equal(ckpt.weights["model.layers.1.self_attn.k_proj.weight"],
                       q.float() * expand_blocks(rows.expand(96, 2), 192))

    if block is None:  # the same values as quantizing in memory from the same dtype: the same tokens
        in_memory = LLM(str(tiny), dtype="float32", quantization="fp8", kv_cache_memory_gb=0.05)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        assert ([o.outputs[0].token_ids for o in served.generate(prompts, params, use_tqdm=False)] ==
                [o.outputs[0].token_ids for o in in_memory.generate(prompts, params, use_tqdm=False)])


def test_transformers_reads_a_block_checkpoint_to_our_values(tmp_path):
    """transformers' own fp8 integration (dequantizing on the CPU) reads what we write in DeepSeek's layout."""
    from transformers import AutoModelForCausalLM

    tiny = make_tiny_hf_dir(tmp_path / "tiny", "llama", kv_heads=2, hidden=256, intermediate=512)
    out = tmp_path / "fp8"
    assert cli_main(["quantize", str(tiny), "--method", "fp8", "--fp8-block", "128", "--dtype", "float32",
                     "--out", str(out)]) == 0
    ours = load_checkpoint(str(out))
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    fp8 = [n for n, f in ours.source_formats.items() if f == "FP8"]
    assert len(fp8) == 14
    for name in fp8:
        assert torch.equal(theirs[name], ours.weights[name]), name


@pytest.mark.skipif(not native_quantized_kernels(), reason="the one native decode call needs the native kernels")
def test_an_fp8_file_runs_on_fp8_layer_by_layer():
    """auto: a file of only FP8 linear weights runs on fp8; its kernel is not in the one native decode call, which
    the same plan on an int8 file takes."""
    from llmserve.config import engine_config
    from llmserve.engine.build_plan import resolve_plan
    from tests.engine.test_build_plan import SMOLLM, _formats

    config = engine_config(kv_cache_memory_gb=0.01, dtype="bfloat16")  # bf16: the native elementwise ops
    fp8 = resolve_plan(config, SMOLLM, _formats("FP8"))
    assert fp8.weights == "fp8" and fp8.small_step_max_tokens == 8 and fp8.fused_decode_max_tokens == 0
    assert fp8.reasons["decode steps"].startswith("fp8 layers run layer by layer")
    assert resolve_plan(config, SMOLLM, _formats("INT8")).fused_decode_max_tokens > 0


def test_in_memory_fp8_greedy_equals_transformers_on_the_same_values(hf_model, prompt_token_ids):
    """`--quantization fp8` on SmolLM2: prompts through the dequantized weights, decodes of up to 8 tokens a step
    through the fp8 kernel, the output head int8; transformers computes with the same values."""
    ref = quantized_reference(hf_model, "fp8")
    expected = [reference_greedy(ref, ids, 24) for ids in prompt_token_ids]
    llm = LLM(dtype="float32", quantization="fp8", kv_cache_memory_gb=0.25, max_model_len=2048)
    plan = llm.engine.plan
    assert plan.weights == "fp8" and plan.small_step_max_tokens == 8 and plan.fused_decode_max_tokens == 0
    assert_greedy_equals(llm, prompt_token_ids, expected, single=3)


@pytest.mark.slow
def test_written_checkpoint_greedy_equals_transformers_reading_it(tmp_path, prompt_token_ids):
    """slow: writes SmolLM2 as fp8 and has transformers read it (compressed-tensors decompression, ~25 s on one core).
    The served checkpoint's greedy tokens equal transformers' on its own reading of the file (its output head made
    int8 as ours is)."""
    pytest.importorskip("compressed_tensors")  # transformers' compressed-tensors integration reads with it
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = tmp_path / "smollm2-fp8"
    assert cli_main(["quantize", "--method", "fp8", "--dtype", "float32", "--out", str(out)]) == 0
    ref = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    ours = load_checkpoint(str(out))
    state = ref.state_dict()
    fp8 = [n for n, f in ours.source_formats.items() if f == "FP8"]
    assert len(fp8) == 7 * 30 and all(torch.equal(state[n], ours.weights[n]) for n in fp8)
    with torch.no_grad():  # the output head int8, as served (its own copy: SmolLM2 ties it to the embedding)
        ref.lm_head.weight = nn.Parameter(WeightOnlyLinear(ref.lm_head.weight, "int8").weight.clone())
    expected = [reference_greedy(ref, ids, 24) for ids in prompt_token_ids]
    llm = LLM(str(out), dtype="float32", kv_cache_memory_gb=0.25, max_model_len=2048)
    assert llm.engine.plan.weights == "fp8"
    assert_greedy_equals(llm, prompt_token_ids, expected, single=3)
