"""The build plan's automatic choices: a 4-bit file runs on the int4 path, anything else as loaded; one
block of log says what was chosen and why; choices asked for by name win."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.config import SpeculativeConfig, engine_config
from llmserve.engine import build_plan
from llmserve.engine.build_plan import AUTO_DRAFT_BELOW, AUTO_SPECULATION_BELOW, resolve_plan
from llmserve.host import cpu_has_vnni
from llmserve.loader import default_models
from llmserve.models.config import ModelConfig, MoEConfig

SMOLLM = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=8192, tie_word_embeddings=True)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _formats(kind: str, down: str | None = None) -> dict[str, str]:
    out = {f"model.layers.{i}.{name}.weight": (down if down and "down" in name else kind)
           for i in range(2) for name in LINEARS}
    out["model.layers.0.input_layernorm.weight"] = "F32"
    out["model.embed_tokens.weight"] = "Q8_0"  # not a decoder linear: never decides
    return out


def _plan(formats, **options):
    return resolve_plan(engine_config(kv_cache_memory_gb=0.01, **options), SMOLLM, formats)


def test_a_4_bit_file_runs_on_the_int4_path_by_default():
    plan = _plan(_formats("Q4_1"))
    assert plan.weights == "int4" and "Q4_1" in plan.reasons["weights"]
    assert plan.int8_activations == cpu_has_vnni()  # ~16-bit inputs: int8 x int8 large steps where VNNI runs them
    assert "int4" in plan.describe() and "build plan" in plan.describe()
    assert _plan(_formats("Q4_0", down="Q4_1")).weights == "int4"
    assert _plan(_formats("Q4_K")).weights == "int4"


def test_a_mostly_4_bit_k_quant_mix_runs_int4_and_int8():
    """Q4_K_M: Q4_K tensors on int4, the few Q6_K ones on int8; a mix that is mostly wider stays as loaded, unless
    int8 holds every wider tensor's values (Q6_K, Q8_0, Q5_0: Qwen2.5-Coder-0.5B's Q4_K_M is mostly Q5_0)."""
    plan = _plan(_formats("Q4_K", down="Q6_K"))
    assert plan.weights == "int4+int8" and "Q6_K" in plan.reasons["weights"]
    assert not plan.int8_activations  # they would cost quality here (auto never picks them)
    # decode steps as one native call, as far as the int8 layers' kernel takes a step: with Q8_0 inputs (the
    # default there) as far as int4's, with ~16-bit ones 8 tokens
    sixteen_bit = _plan(_formats("Q4_K", down="Q6_K"), q8_activations=False)
    if plan.elementwise == "native":
        assert (plan.fused_decode_max_tokens, sixteen_bit.fused_decode_max_tokens) == (32, 8)
        assert "int4 and int8 layers up to 32 tokens" in plan.reasons["small steps"]
    else:
        assert plan.fused_decode_max_tokens == sixteen_bit.fused_decode_max_tokens == 0
    assert _plan(_formats("Q5_K", down="Q4_K")).weights == "as loaded"
    assert _plan(_formats("Q4_K", down="BF16")).weights == "as loaded"
    mostly_q5_0 = _plan(_formats("Q5_0", down="Q4_K"))
    assert mostly_q5_0.weights == "int4+int8" and "the file's values" in mostly_q5_0.reasons["weights"]
    q8_0 = _plan(_formats("Q8_0"))
    assert q8_0.weights == "int8" and "Q8_0, on a grid int8 holds" in q8_0.reasons["weights"]
    assert _plan(_formats("Q4_K", down="Q5_K")).reasons["weights"].endswith("Q5_K per channel)")


def test_every_decode_step_is_one_call_where_the_stack_runs():
    """Past the small-step kernels, decode steps stay in the one call: it makes the layers' large-step products too,
    int8 x int8 or dense; --compile then has nothing left to compile, and says so."""
    plan = _plan(_formats("Q4_1"))
    if not plan.fused_decode_max_tokens:
        pytest.skip("no one-call decode stack on this CPU")
    assert [plan.step_route(True, n, False) for n in (1, 16, 17, 256)] == ["fused"] * 4
    assert plan.step_route(False, 17, False) == "eager"  # prompt tokens: layer by layer
    # (16 tokens; 8 where AMX takes the products from 9)
    large = f"int8 x int8 ({plan.int8_products})" if plan.int8_activations else "dense products"
    assert f"one native call ({large} past {plan.fused_decode_max_tokens} tokens)" in plan.describe()
    # the small-step kernels at every size: the call has no large-step product to name
    assert "one native call;" in _plan(_formats("Q4_1"), large_steps="quantized").describe()
    compiled = _plan(_formats("Q4_1"), compile=True)
    assert compiled.compile == "off" and "nothing is left for --compile" in compiled.reasons["decode steps"]
    dense = _plan(_formats("Q4_1"), large_steps="dense", compile=True)
    assert dense.fused_decode_max_tokens == 16 and dense.compile == "off"
    assert [dense.step_route(True, n, False) for n in (16, 17)] == ["fused", "fused"]
    assert "one native call (dense products past 16 tokens)" in dense.describe()
    assert not dense.batch_invariant
    # without the stack (PyTorch's kernels) --compile still compiles the decode steps
    assert _plan(_formats("Q4_1"), kernels="torch", compile=True).compile == "layers"


@pytest.mark.parametrize("formats", [_formats("Q5_0", down="Q6_K"), _formats("Q8_0"), _formats("Q6_K")])
def test_a_file_int8_holds_runs_int8(formats):
    """Q8_0, Q5_0 and Q6_K values are an integer int8 holds times the file's own scales: int8 keeps them all."""
    plan = _plan(formats)
    assert plan.weights == "int8" and "on a grid int8 holds" in plan.reasons["weights"]
    assert not plan.int8_activations and plan.large_steps == "dense"  # ~16-bit inputs: the dense product is faster


@pytest.mark.parametrize("formats", [_formats("Q5_1"), _formats("Q5_K", down="Q6_K"), _formats("F16"), None])
def test_any_other_file_keeps_its_weights(formats):
    plan = _plan(formats)
    assert plan.weights == "as loaded" and not plan.int8_activations and plan.small_step_max_tokens == 0


def test_choices_asked_for_win():
    assert _plan(_formats("Q4_1"), quantization="none").weights == "as loaded"
    explicit = _plan(_formats("Q5_0"), quantization="int4")
    assert explicit.weights == "int4" and not explicit.int8_activations  # int8 activations only when asked
    assert _plan(_formats("Q4_1"), large_steps="dense").large_steps == "dense"
    if cpu_has_vnni():
        assert _plan(_formats("Q5_0"), quantization="int8", large_steps="int8").int8_activations
    with pytest.raises(ValueError, match="large_steps='int8' needs quantization"):
        engine_config(quantization="none", large_steps="int8")
    with pytest.raises(ValueError, match="large_steps='int8' needs quantized weights"):  # auto kept a Q5_K file
        _plan(_formats("Q5_K"), large_steps="int8")
    with pytest.raises(ValueError, match="large_steps must be one of"):
        engine_config(large_steps="fast")


@pytest.mark.parametrize("vnni", [True, False])
def test_int8_activations_need_vnni(monkeypatch, vnni):
    """Without VNNI oneDNN's uint8 x int8 product saturates its int16 pair sums (on an AVX2-only AMD EPYC,
    tests/kernels/test_int8_gemm.py's first case: -8.50 for -5.48): asked for, int8 activations are refused
    there, and auto never picks them."""
    monkeypatch.setattr(build_plan, "cpu_has_vnni", lambda: vnni)
    assert _plan(_formats("Q4_1")).int8_activations == vnni
    if vnni:
        assert _plan(_formats("Q4_1"), large_steps="int8").int8_activations
    else:
        with pytest.raises(ValueError, match="needs a CPU with VNNI"):
            _plan(_formats("Q4_1"), large_steps="int8")


def _native() -> bool:
    from llmserve.kernels import load_cpu_kernels, native_quantized_kernels

    return load_cpu_kernels() and native_quantized_kernels()


def test_large_steps_by_default_on_the_quantized_kernels_where_inputs_are_q8_0():
    """auto: where the small steps take Q8_0 inputs (a K-quant mix, a draft) every step multiplies on the quantized
    kernels (faster than dense there, no second copy, a token's bits whatever its step holds) and the plan says the
    steps are batch-invariant; with ~16-bit inputs large steps stay int8 x int8 or dense, as asked they run on the
    quantized kernels too; without the native kernels that is refused."""
    mix = _plan(_formats("Q4_K", down="Q6_K"))
    assert mix.large_steps == ("quantized" if _native() else "dense")
    assert mix.batch_invariant == (_native() and mix.attention == "native")
    if mix.batch_invariant:
        assert "no second copy" in mix.describe() and "whatever else its step holds" in mix.describe()
    asked = _plan(_formats("Q4_1"), large_steps="quantized") if _native() else None
    if asked is not None:
        assert asked.large_steps == "quantized" and asked.batch_invariant and "as asked" in asked.reasons["large steps"]
    torch_kernels = _plan(_formats("Q4_1"), kernels="torch")
    assert torch_kernels.large_steps != "quantized" and not torch_kernels.batch_invariant
    assert "round by the step's size" in torch_kernels.reasons["determinism"]
    with pytest.raises(ValueError, match="needs llmserve's native quantized kernels"):
        _plan(_formats("Q4_1"), kernels="torch", large_steps="quantized")


def test_a_draft_runs_the_fastest_weights_head_included():
    """A speculative draft's weights decide what is proposed, never what is kept: auto takes int4 for it, output
    head included, even for a file it would keep on int8 for a target (where the native int4 kernels run)."""
    from llmserve.kernels import load_cpu_kernels, native_quantized_kernels

    target, draft = _plan(_formats("Q5_0", down="Q8_0")), _plan(_formats("Q5_0", down="Q8_0"), draft=True)
    assert target.weights == "int8" and target.head == "int8"
    if load_cpu_kernels() and native_quantized_kernels():
        assert (draft.weights, draft.head) == ("int4", "int4") and "draft" in draft.reasons["weights"]
        assert "output head int4" in draft.describe()
    else:  # PyTorch's int4 kernel would make a draft step dearer than the target's
        assert draft.weights == "int8"
    asked = _plan(_formats("Q5_0"), draft=True, quantization="int8")
    assert (asked.weights, asked.head) == ("int8", "int8")


def test_q8_inputs_by_default_for_a_k_quant_mix():
    """auto: the int4 kernel takes a small step's inputs as Q8_0 (llama.cpp's activations) for a K-quant mix, whose
    int4 layers then take steps up to Q8_MAX_TOKENS where large steps are dense, and for a draft; a 4-bit-only file
    keeps ~16-bit inputs (their cost was measured per kind); asked for, Q8_0 wins; without int4 weights or the
    native kernel it is refused."""
    from llmserve.kernels import load_cpu_kernels, native_quantized_kernels
    from llmserve.quantization.methods import small_step_tokens
    from llmserve.quantization.weight_only import Q8_MAX_TOKENS

    native = load_cpu_kernels() and native_quantized_kernels()
    mix = _plan(_formats("Q4_K", down="Q6_K"))
    assert mix.activation_parts == (1 if native else 2)
    assert mix.small_step_max_tokens == (Q8_MAX_TOKENS if native else small_step_tokens("int4+int8"))
    four_bit = _plan(_formats("Q4_1"), large_steps="dense")
    assert (four_bit.activation_parts, four_bit.small_step_max_tokens) == (2, small_step_tokens("int4"))
    assert "as Q8_0" not in four_bit.describe()
    if native:
        assert "Q8_0" in mix.describe() and "K-quant mix" in mix.reasons["small steps"]
        assert "SmolLM2" in four_bit.reasons["small steps"]
        asked = _plan(_formats("Q4_1"), large_steps="dense", q8_activations=True)
        assert (asked.activation_parts, asked.small_step_max_tokens) == (1, Q8_MAX_TOKENS)
        assert "as asked" in asked.reasons["small steps"]
        assert _plan(_formats("Q4_1"), draft=True).activation_parts == 1
    assert _plan(_formats("Q4_K", down="Q6_K"), quantization="int4+int8").activation_parts == 2
    assert _plan(_formats("Q4_K", down="Q6_K"), q8_activations=False).activation_parts == 2
    with pytest.raises(ValueError, match="q8_activations"):
        _plan(_formats("Q4_1"), quantization="none", q8_activations=True)
    with pytest.raises(ValueError, match="q8_activations"):
        _plan(_formats("Q4_1"), quantization="int8", q8_activations=True)


def test_speculation_by_default_where_one_call_runs_the_decoder():
    """auto: n-gram prompt lookup at low load where decode steps are one native call (a step of a few tokens
    streams the weights once); off where steps run layer by layer; "off" and a config asked for win."""
    plan = _plan(_formats("Q4_1"))
    if plan.fused_decode_max_tokens:
        assert plan.speculative == SpeculativeConfig(disable_by_batch_size=AUTO_SPECULATION_BELOW, automatic=True)
        assert "n-gram prompt lookup" in plan.describe() and "auto" in plan.reasons["speculation"]
    else:
        assert plan.speculative is None and "auto: off" in plan.reasons["speculation"]
    dense = _plan(_formats("F16"))
    assert dense.speculative is None and "auto: off" in dense.reasons["speculation"]
    assert "speculation" in dense.describe()  # says why not
    off = _plan(_formats("Q4_1"), speculative_config="off")
    assert off.speculative is None and "speculation" not in off.describe()
    assert _plan(_formats("F16"), speculative_config="ngram").speculative == SpeculativeConfig()


def test_the_default_drafts_with_the_models_registered_draft(monkeypatch):
    """auto, for a model with a registered draft (Qwen2.5-Coder-1.5B: the 0.5B): the draft where it is installed,
    n-gram lookup where not (the plan says how to get it); the plan loads nothing (the 1.5B need not be here)."""
    if not _plan(_formats("Q4_1")).fused_decode_max_tokens:
        pytest.skip("no one-call decode stack on this host: no speculation by default")
    draft, installed = default_models.registered_draft("qwen2.5-coder-1.5b")
    assert draft == "qwen2.5-coder-0.5b" and default_models.registered_draft(None) == (None, False)
    if installed:
        plan = _plan(_formats("Q4_1"), model="qwen2.5-coder-1.5b")
        assert plan.speculative == SpeculativeConfig(method="draft_model", model=draft,
                                                     disable_by_batch_size=AUTO_DRAFT_BELOW, automatic=True)
        assert f"draft model {draft}" in plan.describe()
    monkeypatch.setattr(default_models, "installed_path", lambda entry: None)
    plan = _plan(_formats("Q4_1"), model="qwen2.5-coder-1.5b")
    assert plan.speculative.method == "ngram" and f"llmserve download {draft}" in plan.reasons["speculation"]


def test_cuda_decode_steps_replay_graphs():
    # resolved on any host: a plan needs no GPU (the KV budget is given, not read from the device)
    plan = _plan(_formats("Q4_1"), device="cuda")
    assert plan.weights == "as loaded" and plan.attention == "torch" and plan.fused_decode_max_tokens == 0
    assert plan.cuda_graph_max_tokens == 64 and "CUDA graphs up to 64 tokens" in plan.describe()
    assert plan.step_route(True, 64, False) == "cuda graph" and plan.step_route(True, 65, False) == "eager"
    assert plan.step_route(False, 8, False) == "eager"  # prompt tokens: layer by layer
    assert _plan(None, device="cuda", max_num_seqs=4).cuda_graph_max_tokens == 4
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert _plan(None, device="cuda", max_num_seqs=4, speculative_config=spec).cuda_graph_max_tokens == 16
    assert _plan(None, device="cuda", compile=True).cuda_graph_max_tokens == 0  # compiled layers, as asked
    assert _plan(None, device="cuda", enforce_eager=True).cuda_graph_max_tokens == 0
    assert _plan(_formats("Q4_1")).cuda_graph_max_tokens == 0  # the CPU


def test_the_device_is_a_gpu_where_there_is_one(monkeypatch):
    plan = _plan(_formats("Q4_1"))
    assert engine_config().model.device == "auto" and plan.device == "cpu" and plan.weights == "int4"
    assert plan.reasons["device"] == "auto: no CUDA GPU" and "device" in plan.describe()
    # a machine with one GPU (the plan only asks torch how many there are; nothing is built)
    monkeypatch.setattr(build_plan.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build_plan.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(build_plan.torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    plan = _plan(_formats("Q4_1"))
    assert plan.device == "cuda" and plan.cuda_graph_max_tokens == 64 and plan.reasons["device"] == "auto: NVIDIA H200"
    asks = [{"quantization": "int4"}, {"kernels": "native"}, {"tensor_parallel_size": 3}]
    for cpu_only in asks + ([{"large_steps": "int8"}] if cpu_has_vnni() else []):  # else refused on this CPU
        assert _plan(_formats("Q4_1"), **cpu_only).device == "cpu", cpu_only
    assert _plan(_formats("Q4_1"), device="cpu").device == "cpu"  # as asked


GEMMA_SHAPED = dataclasses.replace(SMOLLM, architecture="Gemma3ForCausalLM", norm_unit_offset=True, qk_norm=True,
                                   sandwich_norms=True, activation="gelu_tanh", embedding_scale=True,
                                   layer_windows=(512, 0) * 15, local_rope_theta=10_000.0)


def test_every_family_decodes_in_one_native_call_where_its_linears_pack():
    """The one native decode call interprets the model's description: a Gemma-shaped model and a mixture of experts
    take it as Llama's shape does; experts whose rows the int4 kernel cannot pack keep every decode step layer by
    layer."""
    llama_shaped = _plan(_formats("Q4_K")).fused_decode_max_tokens  # (0 on a CPU without the native kernels)
    plan = resolve_plan(engine_config(kv_cache_memory_gb=0.01), GEMMA_SHAPED, _formats("Q4_K"))
    assert plan.weights == "int4" and plan.fused_decode_max_tokens == llama_shaped
    moe = dataclasses.replace(SMOLLM, architecture="MixtralForCausalLM",
                              moe=MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=1536,
                                            normalize_top_k=True))
    plan = resolve_plan(engine_config(kv_cache_memory_gb=0.01), moe, _formats("Q4_K"))
    assert plan.fused_decode_max_tokens == llama_shaped
    unpacked = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, expert_intermediate_size=1544))
    plan = resolve_plan(engine_config(kv_cache_memory_gb=0.01), unpacked, _formats("Q4_K"))
    assert plan.fused_decode_max_tokens == 0


def test_calibrations_run_every_dense_family_and_awq_refuses_experts():
    """AWQ and key smoothing run the serving forward, so a Gemma-shaped model takes both; AWQ's search is of dense
    feed-forward layers, so a mixture of experts is refused, by name."""
    for options in ({"quantization": "awq"}, {"kv_cache_dtype": "int8"}):
        resolve_plan(engine_config(kv_cache_memory_gb=0.01, **options), GEMMA_SHAPED, _formats("Q4_K"))
    moe = dataclasses.replace(SMOLLM, architecture="MixtralForCausalLM",
                              moe=MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=1536,
                                            normalize_top_k=True))
    with pytest.raises(ValueError, match="searches dense layers, and MixtralForCausalLM has experts"):
        resolve_plan(engine_config(kv_cache_memory_gb=0.01, quantization="awq"), moe, None)


def test_experts_never_compile():
    moe = dataclasses.replace(SMOLLM, architecture="MixtralForCausalLM",
                              moe=MoEConfig(num_experts=8, top_k=2, expert_intermediate_size=1536,
                                            normalize_top_k=True))
    plan = resolve_plan(engine_config(kv_cache_memory_gb=0.01, compile=True, quantization="none"), moe, None)
    assert plan.compile == "off" and "experts" in plan.reasons["decode steps"]
