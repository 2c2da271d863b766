"""int8 activations' ranges kept across restarts: a second engine of the same model, configuration and code reads
them instead of running the calibration text, and builds the same int8 layers; another configuration, other code
or an unreadable file measures again."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.host import cpu_has_vnni
from llmserve.loader.default_models import resolve_model_path
from llmserve.quantization import calibration_cache
from llmserve.quantization.weight_only import WeightOnlyLinear

pytestmark = pytest.mark.skipif(not cpu_has_vnni(), reason="int8 activations need VNNI; the build plan refuses them")

OPTIONS = dict(quantization="int4", large_steps="int8", max_model_len=512)
FROM_CACHE = "from the cache of an earlier start"


def _int8_layers(llm: LLM) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each int8 layer's weight in the layout its large-step kernel reads (oneDNN's plain int8, or our AMX
    kernel's packed tiles on hosts with AMX, which keep no plain copy), its scales and its smoothing."""
    layers = {}
    for name, m in llm.engine.runner.model.layers.named_modules():
        if isinstance(m, WeightOnlyLinear):
            weight = m.int8_amx_packed if m.large_step_kernel == "amx" else m.int8_weight
            assert weight is not None, name
            layers[name] = (weight, m.int8_scales, m.smooth_inv)
    return layers


def _greedy(llm: LLM) -> list[int]:
    [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.mark.slow
def test_a_second_start_reads_the_ranges_and_builds_the_same_layers(tmp_path, monkeypatch, caplog) -> None:
    """Three engine starts with int8 activations (the key's rules are checked in the fast tier)."""
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger="llmserve.engine.llm_engine")
    first = LLM(kv_cache_memory_gb=0.25, **OPTIONS)
    assert FROM_CACHE not in caplog.text
    [stored] = (tmp_path / "calibration").iterdir()
    layers, tokens = _int8_layers(first), _greedy(first)
    assert first.engine.kv_cache.pool.num_cached_blocks > 0  # the calibration prompts ran (their blocks stay findable)
    del first

    caplog.clear()
    second = LLM(kv_cache_memory_gb=0.125, **OPTIONS)  # another KV cache size: not part of the key
    assert FROM_CACHE in caplog.text
    assert second.engine.kv_cache.pool.num_cached_blocks == 0  # no calibration prompt ran
    again = _int8_layers(second)
    assert again.keys() == layers.keys()
    assert all(torch.equal(a, b) for name in layers for a, b in zip(again[name], layers[name], strict=True))
    assert _greedy(second) == tokens
    del second

    stored.write_bytes(b"not a torch file")  # unreadable: measured again, and the file rewritten
    caplog.clear()
    third = LLM(kv_cache_memory_gb=0.25, **OPTIONS)
    assert FROM_CACHE not in caplog.text and "unreadable calibration cache file" in caplog.text
    assert calibration_cache.load_ranges(stored.stem) is not None
    assert all(torch.equal(a, b) for name, parts in _int8_layers(third).items()
               for a, b in zip(parts, layers[name], strict=True))


def test_the_key_follows_the_model_configuration_and_plan_not_the_cache_size(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    engine = LLM(kv_cache_memory_gb=0.25, **OPTIONS).engine
    path = resolve_model_path(None)[0]
    config, plan = engine.config, engine.plan
    key = calibration_cache.calibration_key
    base = key(path, config, plan)
    resized = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_memory_gb=3.0))
    assert key(path, resized, dataclasses.replace(plan, num_kv_blocks=plan.num_kv_blocks * 2)) == base
    chunked = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                        long_prefill_token_threshold=64))
    assert key(path, chunked, plan) != base
    assert key(path, config, dataclasses.replace(plan, dtype=torch.float32)) != base
    copy = tmp_path / "copy.gguf"
    with open(path, "rb") as f:
        copy.write_bytes(f.read(1 << 20))  # another file: another identity
    assert key(str(copy), config, plan) != base

    ranges = {"layers.0.mlp.down_proj": torch.arange(4.0)}
    calibration_cache.save_ranges(base, ranges)
    assert torch.equal(calibration_cache.load_ranges(base)["layers.0.mlp.down_proj"], ranges["layers.0.mlp.down_proj"])
    monkeypatch.setattr(calibration_cache, "sources_digest", lambda: "other code")  # what a code change does
    assert calibration_cache.load_ranges(base) is None
