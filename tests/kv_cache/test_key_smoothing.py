"""Key smoothing for the int8 KV cache: folded into q/k rows it leaves the model's function bit for bit (with
a full-precision cache), it moves the int4 grid with the weights, and it makes int8 keys score closer to the
full-precision ones; the engine applies it to an int8 cache only."""

from __future__ import annotations

import copy

import pytest
import torch

from llmserve import LLM
from llmserve.kv_cache.key_smoothing import (
    KeySmoothing,
    fold_key_smoothing,
    key_pair_maxima,
    smooth_keys,
    smoothing_exponents,
)
from llmserve.kv_cache.kv_quant import dequantize_rows, quantize_rows
from llmserve.loader import build_model, load_checkpoint
from llmserve.quantization.awq import calibration_samples
from llmserve.quantization.methods.int4 import quantize_int4


@pytest.fixture(scope="module")
def smollm():
    ckpt = load_checkpoint("smollm2-135m")
    grids = dict(ckpt.int4_grids)
    return build_model(ckpt, torch.float32, "cpu"), ckpt.tokenizer, grids


def _fresh(smollm):
    """A copy of the model and grids to fold into (the module's fixture stays unsmoothed)."""
    model, tokenizer, grids = smollm
    return copy.deepcopy(model), tokenizer, dict(grids)


@torch.no_grad()
def test_folding_keeps_the_model_s_function_bit_for_bit(smollm):
    model, tokenizer, grids = _fresh(smollm)
    ids = calibration_samples(tokenizer, 96)[1]
    before = model.lm_head(model.forward_sequence(ids))
    smoothing = smooth_keys(model, tokenizer, grids, num_tokens=256)
    assert smoothing.num_scaled > 0  # the test means something: some pairs were scaled
    assert all(int(e.min()) >= 0 and int(e.max()) <= 6 for e in smoothing.exponents)
    after = model.lm_head(model.forward_sequence(ids))
    # powers of two: every q . k product is the same float, so everything downstream is too
    assert torch.equal(before, after)


@torch.no_grad()
def test_the_int4_grid_moves_with_the_rows(smollm):
    model, _, grids = _fresh(smollm)
    name = "model.layers.3.self_attn.k_proj.weight"
    name = name if name in grids else name.removeprefix("model.")
    attn = model.layers[3].self_attn
    k_rows = slice(attn.q_size, attn.q_size + attn.kv_size)
    reference = quantize_int4(model.layers[3].self_attn.qkv_proj.weight[k_rows], grids[name]).dequantized
    exponents = [torch.zeros(a.self_attn.num_kv_heads, a.self_attn.head_dim // 2, dtype=torch.int32)
                 for a in model.layers]
    exponents[3][0, :4] = torch.tensor([1, 2, 3, 6], dtype=torch.int32)
    fold_key_smoothing(model, KeySmoothing(exponents), grids)
    scaled = quantize_int4(attn.qkv_proj.weight[k_rows], grids[name]).dequantized
    factor = torch.ones(attn.kv_size)
    for pair, e in enumerate([1, 2, 3, 6]):
        factor[[pair, pair + attn.head_dim // 2]] = 2.0 ** -e
    assert torch.equal(scaled, reference * factor.unsqueeze(1))  # the same int4 levels, rows scaled exactly


def _keys_and_queries(model, ids):
    """Each layer's rotated (q, k) for one sequence, captured from the causal forward."""
    captured = []
    for layer in model.layers:
        attn = layer.self_attn
        original = attn.project

        def project(x, cos_sin, original=original):
            q, k, v = original(x, cos_sin)
            captured.append((q.float(), k.float()))
            return q, k, v
        attn.project = project
    try:
        model.forward_sequence(ids)
    finally:
        for layer in model.layers:
            del layer.self_attn.project
    return captured


def _int8_score_error(q: torch.Tensor, k: torch.Tensor) -> float:
    group = q.shape[1] // k.shape[1]
    k_int8 = dequantize_rows(quantize_rows(k, torch.int8), torch.float32)
    exact = torch.einsum("thd,uhd->htu", q, k.repeat_interleave(group, 1))
    rounded = torch.einsum("thd,uhd->htu", q, k_int8.repeat_interleave(group, 1))
    return float((rounded - exact).square().mean())


@torch.no_grad()
def test_smoothed_int8_keys_score_closer_to_the_exact_ones(smollm):
    """The claim itself: on text it was not calibrated on, q . k over int8 keys errs less once smoothed
    (summed over layers; the same scores exactly, so the errors compare like for like)."""
    model, tokenizer, grids = _fresh(smollm)
    ids = calibration_samples(tokenizer, 128)[2]
    plain = _keys_and_queries(model, ids)
    exponents = smoothing_exponents(key_pair_maxima(model, calibration_samples(tokenizer, 256)[:1]))
    fold_key_smoothing(model, KeySmoothing(exponents), grids)
    smoothed = _keys_and_queries(model, ids)
    before = sum(_int8_score_error(q, k) for q, k in plain)
    after = sum(_int8_score_error(q, k) for q, k in smoothed)
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize("kv, smoothed", [("int8", True), pytest.param("fp8_e4m3", False, marks=pytest.mark.modes),
                                          pytest.param("auto", False, marks=pytest.mark.modes)])
def test_the_engine_smooths_keys_for_an_int8_cache_only(kv, smoothed):
    llm = LLM(kv_cache_dtype=kv, kv_cache_memory_gb=0.05, max_num_seqs=4)
    assert (llm.engine.runner.key_smoothing is not None) == smoothed
