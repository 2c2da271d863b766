"""The fused decode stack (kernels/decode_layer.cpp) computes what the layer-by-layer native path does."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.host import cpu_has_vnni
from llmserve.kernels import native_quantized_kernels
from llmserve.loader.default_models import PARTED_MODELS, installed_path
from llmserve.models.fused_stack import fused_decode_stack
from llmserve.quantization.weight_only import StackedLinear, WeightOnlyLinear
from tests.greedy import assert_fused_equals_layer_by_layer

QWEN = "qwen2.5-coder-0.5b"
pytestmark = pytest.mark.skipif(not native_quantized_kernels(),
                                reason="the native int4 kernels need AVX-512 VNNI or AVX2, which this CPU lacks")


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("bfloat16", "auto"), ("float32", "auto"),
                                                     ("bfloat16", "int8"), ("float32", "fp8_e4m3")])
def test_fused_decode_equals_the_layer_by_layer_native_ops(dtype, kv_cache_dtype, prompt_token_ids):
    """Model-dtype caches take the stack's own K/V copy, 1-byte ones the quantizing write_kv op."""
    llm = LLM(dtype=dtype, quantization="int4", kernels="native", kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_gb=0.25, max_model_len=2048)
    runner = llm.engine.runner
    assert runner.fused_stack is not None and runner.plan.fused_decode_max_tokens == 16
    assert_fused_equals_layer_by_layer(llm, prompt_token_ids[:3], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=5))


@pytest.mark.parametrize(("large_steps", "dtype"), [pytest.param("int8", "bfloat16", marks=pytest.mark.modes),
                                                     ("dense", "bfloat16"), ("quantized", "bfloat16"),
                                                     pytest.param("dense", "float32", marks=pytest.mark.modes)])
def test_larger_decode_steps_run_inside_the_one_call(large_steps, dtype):
    """Past the int4 kernel's crossover a step's products are the layers' large-step ones: int8 x int8 (oneDNN's, or
    our AMX kernel's), dense on the quantized values (oneDNN's packed bf16 weight; the plain float32 one), or the
    int4 kernel itself: the call makes them through the same ops in the same order as the layers do, so the same
    bits. (Prefix caching off: a second run would otherwise prefill after cached blocks, which rounds differently
    from a whole prompt where large steps are not the quantized kernels.)"""
    if large_steps == "int8" and not cpu_has_vnni():
        pytest.skip("int8 activations need VNNI (AVX512-VNNI, AVX-VNNI or AMX)")
    llm = LLM(dtype=dtype, quantization="int4", large_steps=large_steps, kv_cache_memory_gb=0.25,
              max_model_len=512, max_num_seqs=32, enable_prefix_caching=False, speculative_config="off")
    runner = llm.engine.runner
    assert runner.plan.fused_decode_max_tokens in (8, 16)  # 8 where AMX runs 9+
    assert runner.plan.step_route(True, 256, False) == "fused"
    prompts = [[1 + (7 * i + j) % 1000 for j in range(12 + i)] for i in range(24)]
    recording = _RecordingStack(runner.fused_stack)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "fused_stack", recording)
        assert_fused_equals_layer_by_layer(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                          logprobs=3))
    assert max(call[0].shape[0] for call in recording.calls) == len(prompts)  # decode steps of 24 tokens


@pytest.mark.qwen
@pytest.mark.parametrize(("method", "q8"), [("int4", False), ("int4+int8", False), ("int4+int8", True)])
def test_qwen_fused_decode_equals_the_layer_by_layer_native_ops(method, q8):
    """Qwen2's q/k/v biases, and int8 linears beside int4 ones (int4+int8 on Qwen2.5-Coder-0.5B's Q4_K_M file:
    int4 on its Q4_K tensors, int8 on the Q5_0/Q6_K/Q8_0 ones), all on Q8_0 inputs or ~16-bit ones, inside the
    one call, at every decode step's size (ten prompts: past the 8 tokens of ~16-bit int8 linears, the dense large
    steps, the bias inside oneDNN's product): the same bits."""
    if installed_path(PARTED_MODELS[QWEN]) is None:
        pytest.skip(f"{QWEN} is not assembled here (`llmserve download {QWEN}`; setup does it)")
    llm = LLM(QWEN, dtype="bfloat16", quantization=method, large_steps="dense", q8_activations=q8,
              kv_cache_memory_gb=0.25, max_model_len=1024, max_num_seqs=10, enable_prefix_caching=False)
    runner = llm.engine.runner
    linears = [m for m in runner.model.layers.modules() if isinstance(m, WeightOnlyLinear)]
    assert {m.method for m in linears} == set(method.split("+"))
    assert {m.activation_parts for m in linears} == {1 if q8 else 2}  # int8 linears' inputs too
    # int8 linears take steps of up to 8 tokens with ~16-bit inputs, as many as int4's (32) with Q8_0 ones
    assert runner.fused_stack is not None
    assert runner.plan.fused_decode_max_tokens == (16 if method == "int4" else 32 if q8 else 8)
    prompts = _code_prompts(llm, 10)
    # the prompts' step is larger than the one call takes, so both runs compute it layer by layer (a smaller
    # one would run as decodes in the call, and its attention sums in another order than a prefill's)
    assert sum(map(len, prompts)) > runner.plan.fused_decode_max_tokens
    assert_fused_equals_layer_by_layer(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                      logprobs=3))


def _code_prompts(llm: LLM, count: int) -> list[list[int]]:
    texts = ("def is_prime(n):\n    \"\"\"Return whether n is a prime number.\"\"\"",
             "The three laws of thermodynamics are",
             "# Sort a list of tuples by their second item, then by their first\n")
    encode = llm.engine.processor.encode
    return [encode(texts[i % 3] if i < 3 else f"# Example {i}\n{texts[i % 3]}") for i in range(count)]


@pytest.mark.parametrize("q8", [None, False])
def test_rows_of_two_formats_run_inside_the_one_call(mixed_kquant_gguf, q8):
    """The default on a file whose q/k/v rows are Q4_K and Q6_K (tests/models/mixed_gguf.py, Qwen2.5-Coder-1.5B's
    mix): each q/k/v a `StackedLinear` of an int4 and a 6-bit part, inside the one call: the same bits; with ~16-bit
    inputs, decode steps of ten tokens take each part's dense large-step product in the call."""
    llm = LLM(mixed_kquant_gguf, q8_activations=q8, kv_cache_memory_gb=0.1, max_model_len=512, max_num_seqs=10,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.fused_stack is not None and runner.plan.weights == "int4+int8"
    assert all(isinstance(layer.self_attn.qkv_proj, StackedLinear) for layer in runner.model.layers)
    assert runner.plan.fused_decode_max_tokens == (8 if q8 is False else 32)
    prompts = _code_prompts(llm, 10)
    assert sum(map(len, prompts)) > runner.plan.fused_decode_max_tokens  # the prompts' step: layer by layer
    assert_fused_equals_layer_by_layer(llm, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                      logprobs=3))


@pytest.mark.parametrize("options", [dict(quantization=None), dict(quantization="int4", kernels="torch")])
def test_no_fused_stack_without_native_quantized_weights(options):
    llm = LLM(dtype="bfloat16", kv_cache_memory_gb=0.05, max_model_len=256, **options)
    runner = llm.engine.runner
    assert runner.fused_stack is None and runner.plan.fused_decode_max_tokens == 0
    with pytest.raises(ValueError, match="native int4 or int8"):
        fused_decode_stack(runner.model, runner.kv_caches)


def test_the_stack_refuses_mismatched_layers():
    """Built by named fields: a missing, unknown or misshapen one is refused, by name, before any step runs."""
    norm = torch.zeros(16)
    cache = torch.zeros(4, 3, 16, 64)
    table = torch.zeros(32, 64)
    # 9 heads and 3 KV heads of 64: q/k/v has 15 x 64 rows; hidden 16, intermediate 1536
    rows = {"qkv": 15 * 64, "o": 16, "gate_up": 2 * 1536, "down": 16}

    def stack(model=None, layer=None, part=None, sizes=None, linears=None, finish=True, layer_sizes=None):
        made = torch.classes.llmserve.DecodeStack(
            {"embedding": torch.zeros(100, 16), "cos_table": table, "sin_table": table, "final_norm": norm,
             **(model or {})}, {"num_heads": 9, "intermediate_size": 1536}, {"eps": 1e-5, "scale": 0.125})
        made.add_layer({"input_norm": norm, "post_norm": norm, "k_cache": cache, "v_cache": cache, **(layer or {})},
                       layer_sizes or {})
        for name, count in (linears or rows).items():
            tensors = {"weight": norm, "large_weight": norm, **(part or {})}  # None: the field left out
            made.add_part(name, {k: t for k, t in tensors.items() if t is not None},
                          {"rows": count, "activation_parts": 2, "small_max_tokens": 16, "large_kind": 0,
                           **(sizes or {})})
        if finish:
            made.finish()
        return made

    stack()  # the fields above make a stack
    with pytest.raises(RuntimeError, match="unknown field 'qkv_biases'"):
        stack(layer={"qkv_biases": norm})
    with pytest.raises(RuntimeError, match="no field 'cos_table'"):
        torch.classes.llmserve.DecodeStack({"embedding": norm}, {}, {})
    with pytest.raises(RuntimeError, match="unknown linear 'mlp'"):
        stack(linears={**rows, "mlp": 16})
    with pytest.raises(RuntimeError, match="four linears"):
        stack(linears={"qkv": rows["qkv"], "o": 16, "down": 16})
    with pytest.raises(RuntimeError, match="unknown large step 4"):
        stack(sizes={"large_kind": 4})
    # no large step (3): every step on the part's own kernel, and no large-step weight to go with it
    every_step = {"large_kind": 3, "small_max_tokens": 2**63 - 1}
    stack(sizes=every_step, part={"large_weight": None})
    with pytest.raises(RuntimeError, match="takes every step on its own kernel"):
        stack(sizes=every_step)
    with pytest.raises(RuntimeError, match="takes every step on its own kernel"):
        stack(sizes={"large_kind": 3}, part={"large_weight": None})
    with pytest.raises(RuntimeError, match="needs its large-step weight"):
        stack(part={"large_weight": torch.empty(0)})
    with pytest.raises(RuntimeError, match="one value per row"):
        stack(layer={"qkv_bias": norm})
    with pytest.raises(RuntimeError, match="add up to its rows"):  # q/k/v: (9 + 2 x 3 heads) x 64
        stack(linears={**rows, "qkv": 14 * 64})
    with pytest.raises(RuntimeError, match="caches must be"):
        stack(layer={"v_cache": torch.zeros(4, 3, 16)})
    with pytest.raises(RuntimeError, match="the embedding must be"):
        stack(model={"embedding": torch.zeros(100, 15)})
    with pytest.raises(RuntimeError, match="rotary tables must be"):
        stack(model={"cos_table": torch.zeros(32, 32)})
    with pytest.raises(RuntimeError, match="rotary tables must be"):
        stack(model={"sin_table": torch.zeros(31, 64)})
    with pytest.raises(RuntimeError, match="final norm's weights"):
        stack(model={"final_norm": torch.zeros(15)})
    # what other families add: each a named field, checked against the rest
    head_norm = torch.zeros(64)
    stack(model={"local_cos_table": table, "local_sin_table": table, "embedding_scale": torch.tensor(4.0)},
          layer={"q_norm": head_norm, "k_norm": head_norm, "pre_feedforward_norm": norm,
                 "post_feedforward_norm": norm}, layer_sizes={"window": 24, "rope": 1},
          sizes=None)
    with pytest.raises(RuntimeError, match="query and key norms or neither"):
        stack(layer={"q_norm": head_norm})
    with pytest.raises(RuntimeError, match="both sandwich norms or neither"):
        stack(layer={"pre_feedforward_norm": norm})
    with pytest.raises(RuntimeError, match="one contiguous weight per head feature"):
        stack(layer={"q_norm": norm, "k_norm": norm})
    with pytest.raises(RuntimeError, match="where a layer takes them"):
        stack(layer_sizes={"rope": 1})
    with pytest.raises(RuntimeError, match="where a layer takes them"):
        stack(model={"local_cos_table": table, "local_sin_table": table})
    with pytest.raises(RuntimeError, match="rope is 0"):
        stack(layer_sizes={"rope": 2})
    with pytest.raises(RuntimeError, match="unknown field 'windows'"):
        stack(layer_sizes={"windows": 24})
    with pytest.raises(RuntimeError, match="one value in the embedding's dtype"):
        stack(model={"embedding_scale": torch.ones(2)})
    # experts in place of gate_up and down: a router row each, in order, and a top k
    router = torch.zeros(2, 16)
    expert_rows = {"qkv": rows["qkv"], "o": 16}

    def with_experts(layer=None, expert_order=(0, 0, 1, 1)):
        made = stack(layer={"router": router, **(layer or {})}, linears=expert_rows, finish=False)
        for index, name in zip(expert_order, ("expert_gate_up", "expert_down") * 2, strict=True):
            made.add_part(name, {"weight": norm, "large_weight": norm},
                          {"rows": 64 if name == "expert_gate_up" else 16, "activation_parts": 2,
                           "small_max_tokens": 16, "large_kind": 0, "expert": index})
        made.finish()

    with pytest.raises(RuntimeError, match="needs top_k"):  # (a model size; the families' tests build real ones)
        with_experts()
    with pytest.raises(RuntimeError, match="experts come in order"):
        with_experts(expert_order=(0, 0, 2, 2))
    with pytest.raises(RuntimeError, match="a row per expert"):
        with_experts(layer={"router": torch.zeros(3, 16)})
    with pytest.raises(RuntimeError, match="a shared expert comes with its gate"):
        with_experts(layer={"shared_expert_gate": torch.zeros(1, 16)})
    with pytest.raises(RuntimeError, match="unknown activation 2"):
        torch.classes.llmserve.DecodeStack({"embedding": torch.zeros(100, 16), "cos_table": table, "sin_table": table,
                                            "final_norm": norm}, {"num_heads": 9, "intermediate_size": 1536,
                                                                  "activation": 2}, {"eps": 1e-5, "scale": 0.125})
    unfinished = stack(finish=False)
    with pytest.raises(RuntimeError, match="not finished"):
        unfinished.run(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.zeros(3, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                       torch.ones(1, dtype=torch.int32))


class _RecordingStack:
    """The runner's fused stack, keeping each call's arguments."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, []

    def run(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls.append(args)
        return self.stack.run(*args)


def test_the_timed_call_computes_the_same_and_times_every_piece(prompt_token_ids):
    """`run_timed` (the step's split by piece, benchmarks/bandwidth_ceiling.py) is `run` with a clock around each
    piece: the same output and K/V, and a time for every piece of every layer."""
    llm = LLM(dtype="bfloat16", quantization="int4", kernels="native", kv_cache_memory_gb=0.25, max_model_len=2048)
    runner = llm.engine.runner
    recording = _RecordingStack(runner.fused_stack)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "fused_stack", recording)
        llm.generate(prompt_token_ids[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    captured = recording.calls
    assert captured and captured[-1][0].shape[0] == 2  # the last step decodes both prompts
    step = captured[-1]
    pieces = torch.classes.llmserve.DecodeStack.pieces()
    assert pieces[:2] == ["input norm", "q/k/v"] and "attention" in pieces and pieces[-1] == "final norm"
    plain = runner.fused_stack.run(*step)
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    seconds = torch.zeros(len(pieces), dtype=torch.float64)
    timed = runner.fused_stack.run_timed(*step, seconds)
    assert torch.equal(timed, plain)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, caches,
                                                                                    strict=True))
    assert (seconds > 0).all()
    again = seconds.clone()
    runner.fused_stack.run_timed(*step, seconds)  # adds to what is there
    assert (seconds > again).all()
    with pytest.raises(RuntimeError, match=f"float64 tensor of {len(pieces)} elements"):
        runner.fused_stack.run_timed(*step, torch.zeros(len(pieces), dtype=torch.float32))
    with pytest.raises(RuntimeError, match=f"float64 tensor of {len(pieces)} elements"):
        runner.fused_stack.run_timed(*step, torch.zeros(3, dtype=torch.float64))
    # a token or position past the tables is refused before anything is written
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    input_ids, positions, *rest = step
    vocab, max_position = runner.model.config.vocab_size, runner.model.rotary.cos_cache.shape[0]
    with pytest.raises(RuntimeError, match="token id out of range"):
        runner.fused_stack.run(torch.tensor([0, vocab]), positions, *rest)
    with pytest.raises(RuntimeError, match="position out of range"):
        runner.fused_stack.run(input_ids, torch.tensor([0, max_position]), *rest)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, caches,
                                                                                    strict=True))
    # an error inside the layers, where torch's threads are held as one team (kernels/team.h), reaches the caller
    # and leaves no thread behind: the next call runs as before
    assert torch.get_num_threads() >= 2
    slots, block_table, context_lens = rest
    with pytest.raises(RuntimeError, match="block_table and context_lens must be int32"):
        runner.fused_stack.run(input_ids, positions, slots, block_table.long(), context_lens)
    assert torch.equal(runner.fused_stack.run(*step), plain)
