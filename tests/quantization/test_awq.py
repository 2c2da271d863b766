"""AWQ: the scales are finite and invertible (folded, the model computes what it did), the search never does
worse than round to nearest on the calibration data, scales and clips are kept only where the int4 model's
calibration loss says so, and a checkpoint `llmserve quantize` writes serves the same tokens as the engine
that quantized in memory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from llmserve import LLM, SamplingParams
from llmserve.cli import main as cli_main
from llmserve.config import ModelConfig
from llmserve.loader import build_model, load_checkpoint
from llmserve.quantization.awq import (
    AWQConfig,
    awq_quantize,
    calibration_samples,
    scaled_int4_weight,
)
from llmserve.quantization.int4_groups import fake_quantize
from llmserve.quantization.quantize_checkpoint import SERVE_AWQ_GROUP_SIZE, quantize_checkpoint
from llmserve.quantization.weight_only import WeightOnlyLinear
from tests.quantization.tiny_models import make_tiny_hf_dir

# small enough for 2 cores: a coarse alpha grid, short calibration sequences
QUICK = AWQConfig(group_size=32, grid=5, max_seq_len=128)
# every scale folded (AutoAWQ's way), no clips: what the folding and search tests look at
ALL_SCALES = AWQConfig(group_size=32, grid=5, max_seq_len=128, clip=False, select_by_loss=False)


def _dense_model(path):
    ckpt = load_checkpoint(str(path))
    return build_model(ckpt, torch.float32, "cpu"), ckpt.tokenizer


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Our model's logits for one sequence, PyTorch ops, no KV cache (the calibration's forward pass)."""
    return model.lm_head(model.forward_sequence(ids))


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory):
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-gqa"), "qwen2", kv_heads=2)


@pytest.fixture(scope="module")
def tiny_mha(tmp_path_factory):  # one v head per query head: o_proj's scales are searched too
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-mha"), "llama", kv_heads=4)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):  # unit-offset norms, the MLP's input from its pre-feed-forward norm, a window
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", kv_heads=4)


def _norm_scale(norm) -> torch.Tensor:
    """What a norm multiplies by: its weight, or 1 + its weight (Gemma)."""
    return norm.weight + float(norm.unit_offset)


@pytest.mark.parametrize("kind", ["tiny_gqa", "tiny_mha", "tiny_gemma3"])
@torch.no_grad()
def test_scales_are_finite_and_folding_them_keeps_the_function(kind, request):
    path = request.getfixturevalue(kind)
    original, tokenizer = _dense_model(path)
    folded, _ = _dense_model(path)
    samples = calibration_samples(tokenizer, QUICK.max_seq_len)[:4]
    result = awq_quantize(folded, samples, ALL_SCALES, quantize=False)
    blocks = {s.block for s in result.searches}
    assert blocks == ({"qkv", "gate_up", "down"} if kind == "tiny_gqa" else {"qkv", "gate_up", "down", "o"})
    for s in result.searches:
        assert torch.isfinite(s.scales).all() and (s.scales > 0).all()
        assert torch.isfinite(1 / s.scales).all()
    assert any(s.alpha > 0 for s in result.searches)  # not vacuous: some scales are not all ones
    assert any((s.scales - 1).abs().max() > 0.5 for s in result.searches)
    # the folded model (not quantized) computes the original's logits, to float32's rounding of their scale
    for ids in samples[:2]:
        expected = _logits(original, ids)
        atol = 1e-4 * max(1.0, expected.abs().max())
        torch.testing.assert_close(_logits(folded, ids), expected, rtol=1e-4, atol=atol)
    # and unfolding gives the original weights back: the norm times s, the linear's columns over s
    qkv = next(s for s in result.searches if s.layer == 0 and s.block == "qkv")
    layer, base = folded.layers[0], original.layers[0]
    torch.testing.assert_close(_norm_scale(layer.input_layernorm) * qkv.scales, _norm_scale(base.input_layernorm))
    gate_up = next(s for s in result.searches if s.layer == 0 and s.block == "gate_up")
    mlp_norm = "pre_feedforward_layernorm" if kind == "tiny_gemma3" else "post_attention_layernorm"
    torch.testing.assert_close(_norm_scale(layer.get_submodule(mlp_norm)) * gate_up.scales,
                               _norm_scale(base.get_submodule(mlp_norm)))
    if kind == "tiny_gqa":  # (with MHA the v rows also carry o's scales)
        torch.testing.assert_close(layer.self_attn.qkv_proj.weight / qkv.scales, base.self_attn.qkv_proj.weight)


@torch.no_grad()
def test_search_error_is_at_most_round_to_nearest(tiny_gqa):
    """The search's block errors against an independent computation: round to nearest of q/k/v, and the
    final AWQ model's attention block (folded norm, its q/k/v on their int4 groups), both against the
    full-precision block on the calibration data."""
    original, tokenizer = _dense_model(tiny_gqa)
    awq, _ = _dense_model(tiny_gqa)
    samples = calibration_samples(tokenizer, QUICK.max_seq_len)[:4]
    result = awq_quantize(awq, samples, ALL_SCALES)
    for s in result.searches:
        assert s.error <= s.rtn_error
    assert any(s.error < 0.95 * s.rtn_error for s in result.searches)  # the outlier channels: AWQ helps

    base = original.layers[0]
    xs = [original.embed_tokens(ids) for ids in samples]
    cos_sins = [original.rotary.lookup(torch.arange(len(ids)), torch.float32) for ids in samples]

    def block(layer, o_proj):  # the attention block's output on layer 0's calibration inputs, on SDPA here
        outs = []
        for x, cs in zip(xs, cos_sins, strict=True):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cs)
            repeat = attn.num_heads // attn.num_kv_heads
            q, k, v = (t.transpose(0, 1) for t in (q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
            outs.append(o_proj(o.transpose(0, 1).flatten(1)))
        return torch.cat(outs)

    reference = block(base, base.self_attn.o_proj)
    weight = base.self_attn.qkv_proj.weight.clone()
    base.self_attn.qkv_proj.weight.copy_(fake_quantize(weight, 32))
    rtn = (block(base, base.self_attn.o_proj) - reference).pow(2).mean().item()
    base.self_attn.qkv_proj.weight.copy_(weight)
    quantized = (block(awq.layers[0], base.self_attn.o_proj) - reference).pow(2).mean().item()  # o_proj: fp
    search = next(s for s in result.searches if s.layer == 0 and s.block == "qkv")
    assert rtn == pytest.approx(search.rtn_error, rel=1e-4)
    assert quantized == pytest.approx(search.error, rel=1e-4)
    assert quantized <= rtn


def _nll(model, samples) -> float:
    return sum(torch.nn.functional.cross_entropy(_logits(model, ids)[:-1].float(), ids[1:], reduction="sum").item()
               for ids in samples) / sum(len(ids) - 1 for ids in samples)


@torch.no_grad()
def test_a_scale_trial_computes_what_the_folded_int4_model_does(tiny_mha):
    """The scale selection tries kinds without folding: each linear's int4 weight mapped back. With every
    kind on, the unfolded model with those weights gives the folded int4 model's logits (MHA: o's scales
    divide v's rows of qkv_proj, so a linear carries two blocks' scales)."""
    folded, tokenizer = _dense_model(tiny_mha)
    unfolded, _ = _dense_model(tiny_mha)
    samples = calibration_samples(tokenizer, QUICK.max_seq_len)[:2]
    result = awq_quantize(folded, samples, ALL_SCALES)  # all four kinds folded, then int4
    assert result.scaled == ["qkv", "o", "gate_up", "down"] and not result.scale_losses
    int4_weight = scaled_int4_weight(unfolded, result.searches, 32)
    for i, layer in enumerate(unfolded.layers):
        for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear = layer.get_submodule(part)
            linear.weight.copy_(int4_weight(set(result.scaled), f"layers.{i}.{part}", linear.weight))
    for ids in samples:
        torch.testing.assert_close(_logits(unfolded, ids), _logits(folded, ids), rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_scales_are_kept_only_where_they_lower_the_quantized_model_s_loss(tiny_gqa):
    model, tokenizer = _dense_model(tiny_gqa)
    samples = calibration_samples(tokenizer, QUICK.max_seq_len)[:4]
    result = awq_quantize(model, samples, AWQConfig(group_size=32, grid=5, max_seq_len=128, clip=False))
    assert set(result.scale_losses) == {"none", "qkv", "gate_up", "down"}  # GQA: no o scales
    assert _nll(model, samples) == pytest.approx(min(result.scale_losses.values()), rel=1e-5)
    assert set(result.scaled) <= {"qkv", "gate_up", "down"}
    # the folded norms show which were kept
    original, _ = _dense_model(tiny_gqa)
    folded_norm = not torch.equal(model.layers[0].input_layernorm.weight, original.layers[0].input_layernorm.weight)
    assert folded_norm == ("qkv" in result.scaled)


@torch.no_grad()
def test_clips_are_kept_only_where_they_lower_the_quantized_model_s_loss(tiny_gqa):
    """The clip of each kind of linear is tried on the int4 model; the model it leaves is the tried one with
    the least calibration loss, never worse than no clipping."""
    model, tokenizer = _dense_model(tiny_gqa)
    samples = calibration_samples(tokenizer, QUICK.max_seq_len)[:4]
    result = awq_quantize(model, samples, QUICK)  # clip on; the linears end on their int4 values
    assert set(result.clip_losses) == {"none", "v", "o", "gate_up", "down"}
    nll = _nll(model, samples)
    assert nll == pytest.approx(min(result.clip_losses.values()), rel=1e-6)
    assert nll <= result.clip_losses["none"]
    assert set(result.clipped) <= {"v", "o", "gate_up", "down"}


@pytest.fixture(scope="module")
def tiny_one_layer(tmp_path_factory):  # the round trip searches twice at the engine's full settings: kept small
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny-1"), "qwen2", kv_heads=2, hidden=64, intermediate=128,
                            layers=1)


@pytest.fixture(scope="module")
def written(tiny_one_layer, tmp_path_factory):
    out = tmp_path_factory.mktemp("awq-out")
    assert cli_main(["quantize", str(tiny_one_layer), "--method", "awq", "--group-size", str(SERVE_AWQ_GROUP_SIZE),
                     "--out", str(out)]) == 0
    return out


def test_quantize_writes_autoawq_layout(written, tiny_one_layer):
    config = json.loads((written / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": SERVE_AWQ_GROUP_SIZE,
                                             "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    with safe_open(str(written / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
        scales = f.get_tensor("model.layers.0.mlp.down_proj.scales")
    assert qweight.dtype == torch.int32 and qweight.shape == (128, 64 // 8)  # [in, out / 8]
    assert scales.dtype == torch.float16 and scales.shape == (128 // SERVE_AWQ_GROUP_SIZE, 64)
    assert "model.layers.0.self_attn.q_proj.bias" in names and "model.layers.0.input_layernorm.weight" in names
    assert not any(n.endswith("proj.weight") and ".layers." in n for n in names)
    # the norms hold the folded scales where those were kept (the provenance says which)
    kept = config["llmserve_quantization"]["scales_kept"]
    assert set(kept) <= {"qkv", "gate_up", "down"} and "clips_kept" in config["llmserve_quantization"]
    src = load_checkpoint(str(tiny_one_layer)).weights
    with safe_open(str(written / "model.safetensors"), "pt") as f:
        for norm, kind in (("input_layernorm", "qkv"), ("post_attention_layernorm", "gate_up")):
            name = f"model.layers.0.{norm}.weight"
            assert torch.equal(f.get_tensor(name).float(), src[name].float()) == (kind not in kept)
    assert (written / "tokenizer.json").exists() and (written / "generation_config.json").exists()


def test_served_checkpoint_equals_the_model_that_wrote_it(written, tiny_one_layer):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village"]
    writer = LLM(str(tiny_one_layer), quantization="awq", kv_cache_memory_gb=0.05)
    served = LLM(str(written), kv_cache_memory_gb=0.05, large_steps="dense")  # auto: int4, not re-searched
    assert served.engine.plan.weights == writer.engine.plan.weights == "int4"
    for a, b in zip(writer.engine.runner.model.modules(), served.engine.runner.model.modules(), strict=True):
        if isinstance(a, WeightOnlyLinear):
            assert torch.equal(a.qweight, b.qweight)  # the same int4 values, scales and minimums
    expected = [o.outputs[0].token_ids for o in writer.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in served.generate(prompts, params, use_tqdm=False)] == expected
    dense = LLM(str(tiny_one_layer), quantization="none", kv_cache_memory_gb=0.05)
    assert [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)] != expected


def test_an_awq_checkpoint_is_not_searched_again(written):
    ckpt = load_checkpoint(str(written))
    assert ckpt.int4_groups and all(g.group_size == SERVE_AWQ_GROUP_SIZE for g in ckpt.int4_groups.values())
    again, result = quantize_checkpoint(ckpt, "awq", AWQConfig())
    assert again is ckpt and result is None


def test_bad_methods_are_refused(tiny_gqa, tmp_path, capsys):
    assert cli_main(["quantize", str(tiny_gqa), "--method", "squeezellm", "--out", str(tmp_path / "x")]) == 2
    assert "--method must be one of ['awq', 'fp8', 'gptq', 'int4', 'int8'], got 'squeezellm'" in capsys.readouterr().err
    assert cli_main(["quantize", str(tiny_gqa), "--method", "awq", "--group-size", "48",
                     "--out", str(tmp_path / "y")]) == 2
    assert "multiple of 32" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="awq4")
    with pytest.raises(ValueError, match="one of \\['awq', 'gptq', 'int4'\\]"):
        quantize_checkpoint(load_checkpoint(str(tiny_gqa)), "squeezellm", AWQConfig())
    with pytest.raises(ValueError, match="gptq takes a GPTQConfig"):
        quantize_checkpoint(load_checkpoint(str(tiny_gqa)), "gptq", AWQConfig())


def test_build_plan_runs_awq_and_quantized_checkpoints_on_their_paths():
    from llmserve.config import engine_config
    from llmserve.engine.build_plan import resolve_plan
    from llmserve.loader.awq_format import AWQ_FORMAT
    from llmserve.loader.int8_format import INT8_FORMAT
    from tests.engine.test_build_plan import SMOLLM, _formats

    def plan(formats, **options):
        return resolve_plan(engine_config(kv_cache_memory_gb=0.01, **options), SMOLLM, formats)

    asked = plan(_formats("F16"), quantization="awq")
    assert asked.weights == "int4" and "awq" in asked.reasons["weights"]
    assert not asked.int8_activations  # asked for by name: the weights alone
    assert plan(_formats(AWQ_FORMAT)).weights == "int4"  # an AWQ directory, by default
    assert plan(_formats(INT8_FORMAT)).weights == "int8"  # an int8 directory
    assert plan(_formats(AWQ_FORMAT), quantization="none").weights == "as loaded"


def test_a_mixture_of_experts_model_is_refused(tmp_path):
    model, tokenizer = _dense_model(make_tiny_hf_dir(tmp_path, "mixtral", hidden=64, intermediate=64))
    with pytest.raises(ValueError, match="mixtures of experts"):
        awq_quantize(model, calibration_samples(tokenizer, 32)[:1], QUICK)
