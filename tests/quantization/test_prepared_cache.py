"""A quantized model as built is kept for the next start, which maps it instead of building it again."""

from __future__ import annotations

import time

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.kernels import native_quantized_kernels
from llmserve.loader import gguf
from llmserve.quantization import calibration_cache, prepared_cache, weight_arena
from llmserve.quantization.weight_arena import streamed_weights

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42, 7, 99, 1000, 5]]


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(prepared_cache, "MIN_BUILD_SECONDS", 0.0)  # the small default model is stored too
    return tmp_path / "prepared"


def _engine() -> LLM:
    llm = LLM(kv_cache_memory_gb=0.05, max_model_len=512,
              large_steps="quantized" if native_quantized_kernels() else "auto")
    if llm.engine.runner.prepared_writer is not None:
        llm.engine.runner.prepared_writer.join()
    return llm


def _outputs(llm: LLM) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_a_second_start_maps_the_model_the_first_built(cache_folder):
    built = _engine()
    if built.engine.plan.weights == "as loaded" or not built.engine.plan.batch_invariant:
        pytest.skip("only a model quantized as it loads is stored (the native kernels run here)")
    assert not built.engine.runner.prepared_from_cache and len(list(cache_folder.glob("*.pt"))) == 1
    mapped = _engine()
    assert mapped.engine.runner.prepared_from_cache and mapped.engine.runner.prepared_writer is None
    assert _outputs(mapped) == _outputs(built)  # the same bits


def _streamed_storages(llm: LLM) -> set[int]:
    return {module._buffers[name].untyped_storage().data_ptr()
            for module, name in streamed_weights(llm.engine.runner.model)}


def test_a_mapped_start_reads_no_grids_and_moves_onto_huge_pages_between_steps(cache_folder, monkeypatch):
    grids_read = []
    real_int4_grid = gguf.int4_grid
    monkeypatch.setattr(gguf, "int4_grid", lambda tensor: grids_read.append(tensor.name) or real_int4_grid(tensor))
    built = _engine()
    if built.engine.plan.weights == "as loaded" or not built.engine.plan.batch_invariant:
        pytest.skip("only a model quantized as it loads is stored (the native kernels run here)")
    assert grids_read  # the build quantizes on the file's own grids
    expected = _outputs(built)
    grids_read.clear()
    mapped = _engine()
    runner = mapped.engine.runner
    assert runner.prepared_from_cache and not grids_read  # the file's grids are never read
    if not mapped.engine.plan.huge_pages:
        pytest.skip("no huge-page arena on this host")
    # serving starts on the file's pages, with the arena prepared beside it
    file_storages = {s.data_ptr() for s in prepared_cache.mapped_storages(runner.model)}
    assert runner.arena_pending and _streamed_storages(mapped) <= file_storages
    runner._arena._thread.join()
    assert _outputs(mapped) == expected  # its first step moved the weights: the same bits from the arena
    assert not runner.arena_pending and len(storages := _streamed_storages(mapped)) == 1
    assert storages.isdisjoint(file_storages)
    assert _outputs(mapped) == expected  # and the one-call stack was rebuilt on them


def test_a_refused_arena_leaves_a_mapped_start_serving_from_the_file(cache_folder, monkeypatch):
    built = _engine()
    if built.engine.plan.weights == "as loaded" or not built.engine.plan.batch_invariant \
            or not built.engine.plan.huge_pages:
        pytest.skip("needs a stored model and the huge-page arena (the native kernels and THP)")
    expected = _outputs(built)

    def refused(entries):
        raise OSError("huge pages refused")

    monkeypatch.setattr(weight_arena, "_arena", refused)
    mapped = _engine()
    runner = mapped.engine.runner
    file_storages = {s.data_ptr() for s in prepared_cache.mapped_storages(runner.model)}
    runner._arena._thread.join()
    assert _outputs(mapped) == expected and not runner.arena_pending
    assert _streamed_storages(mapped) <= file_storages  # nothing moved


def test_shutdown_waits_for_the_prepared_weights_being_written(cache_folder, monkeypatch):
    real_save = torch.save

    def slow_save(*args, **kwargs):
        time.sleep(1.0)  # the write outlasts the start: the shutdown below comes first
        return real_save(*args, **kwargs)

    monkeypatch.setattr(prepared_cache.torch, "save", slow_save)
    llm = LLM(kv_cache_memory_gb=0.05, max_model_len=512,
              large_steps="quantized" if native_quantized_kernels() else "auto")
    writer = llm.engine.runner.prepared_writer
    if writer is None:
        pytest.skip("only a model quantized as it loads is stored (the native kernels run here)")
    assert writer.is_alive()
    llm.engine.shutdown()
    assert not writer.is_alive()
    assert len(list(cache_folder.glob("*.pt"))) == 1 and not list(cache_folder.glob("*.tmp*"))


def test_a_model_stored_by_other_code_or_unreadable_is_built_again(cache_folder, monkeypatch):
    first = _engine()
    if first.engine.runner.prepared_writer is None and not list(cache_folder.glob("*.pt")):
        pytest.skip("only a model quantized as it loads is stored (the native kernels run here)")
    monkeypatch.setattr(calibration_cache, "sources_digest", lambda: "other code")
    monkeypatch.setattr(prepared_cache, "sources_digest", lambda: "other code")
    assert not _engine().engine.runner.prepared_from_cache  # and stored again, by this "code"
    assert _engine().engine.runner.prepared_from_cache
    [stored] = cache_folder.glob("*.pt")
    garbled = stored.with_suffix(".garbled")  # replaced as a write replaces it: the mapped engines keep their file
    garbled.write_bytes(b"not a model")
    garbled.replace(stored)
    rebuilt = _engine()
    assert not rebuilt.engine.runner.prepared_from_cache and _outputs(rebuilt) == _outputs(first)


def test_the_folder_keeps_the_most_recently_used(cache_folder, monkeypatch):
    monkeypatch.setattr(prepared_cache, "KEEP", 2)
    model = torch.nn.Linear(2, 2)
    for key in ("a", "b", "c"):
        prepared_cache.save_prepared(key, model, build_seconds=1.0).join()
    assert sorted(p.stem for p in cache_folder.glob("*.pt")) == ["b", "c"]
    assert isinstance(prepared_cache.load_prepared("b"), torch.nn.Linear)
    prepared_cache.save_prepared("d", model, build_seconds=1.0).join()
    assert sorted(p.stem for p in cache_folder.glob("*.pt")) == ["b", "d"]  # "b" was read after "c" was written
    monkeypatch.setattr(prepared_cache, "MIN_BUILD_SECONDS", 2.0)
    assert prepared_cache.save_prepared("e", model, build_seconds=1.0) is None  # built about as fast as it is read
