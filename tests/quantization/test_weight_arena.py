"""The streamed weights on huge pages: one arena, in the order a step reads them, the same bytes, the same tokens."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine import build_plan
from llmserve.host import transparent_huge_pages
from llmserve.kernels import native_quantized_kernels
from llmserve.quantization.weight_arena import HUGE_PAGE, place_on_huge_pages, streamed_weights
from tests.quantization.tiny_models import make_tiny_hf_dir

pytestmark = pytest.mark.skipif(not native_quantized_kernels(), reason="needs the native quantized kernels")
THP = transparent_huge_pages() in ("always", "madvise")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_dir(tmp_path_factory.mktemp("arena") / "qwen2", layers=3)


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the arena")


def _streamed(llm: LLM) -> list[torch.Tensor]:
    return [module._buffers[name] for module, name in streamed_weights(llm.engine.runner.model)]


@pytest.mark.skipif(not THP, reason="transparent huge pages are off on this host")
def test_the_streamed_weights_are_one_huge_page_arena_in_step_order(tiny_dir):
    llm = LLM(str(tiny_dir), quantization="int4", kv_cache_memory_gb=0.01, speculative_config="off")
    plan = llm.engine.plan
    assert plan.huge_pages and "weight memory" in plan.describe()
    model = llm.engine.runner.model
    tensors = _streamed(llm)
    # q/k/v, o, gate/up, down per layer (packed weight and, for int8, scales), then the int8 head's two
    linears = [m for m in model.modules() if isinstance(getattr(m, "qweight", None), torch.Tensor)]
    assert len(linears) == 3 * 4 + 1 and linears[-1] is model.lm_head
    assert len(tensors) == len(linears) + sum(isinstance(m._buffers.get("scales"), torch.Tensor) for m in linears)
    storage = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in tensors)  # views of one arena
    addresses = [t.data_ptr() for t in tensors]
    assert addresses == sorted(addresses) and all(a % 64 == 0 for a in addresses)
    assert all(a + t.nbytes <= b for a, b, t in zip(addresses, addresses[1:], tensors, strict=False))  # no overlap
    assert addresses[0] % HUGE_PAGE == 0
    assert _huge_kib_at(addresses[0]) >= HUGE_PAGE // 1024  # the kernel gave the arena huge pages


def test_placing_changes_no_byte_and_no_token(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 250], [7, 7, 8, 400, 12, 13, 14], [300]]
    plain = LLM(str(tiny_dir), quantization="int4", kv_cache_memory_gb=0.01, speculative_config="off",
                huge_pages=False)
    assert not plain.engine.plan.huge_pages
    before = [t.clone() for t in _streamed(plain)]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    placed = place_on_huge_pages(plain.engine.runner.model)
    after = _streamed(plain)
    assert placed >= sum(t.nbytes for t in after)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after, strict=True))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(before, after, strict=True))
    if THP:  # the engine's own placement, as a default engine makes it: the same tokens as on the allocator's pages
        placed_llm = LLM(str(tiny_dir), quantization="int4", kv_cache_memory_gb=0.01, speculative_config="off")
        assert placed_llm.engine.plan.huge_pages
        assert [o.outputs[0].token_ids for o in placed_llm.generate(prompts, params, use_tqdm=False)] == expected


def test_the_plan_places_only_native_quantized_weights_and_says_why_not(tiny_dir, monkeypatch):
    from llmserve.config import engine_config
    from llmserve.loader import load_checkpoint

    config = load_checkpoint(str(tiny_dir)).config

    def plan(**options):
        return build_plan.resolve_plan(engine_config(kv_cache_memory_gb=0.01, **options), config)

    assert not plan(quantization="none").huge_pages  # dense weights: nothing of ours to place
    with pytest.raises(ValueError, match="huge_pages places quantized weights"):
        plan(quantization="none", huge_pages=True)
    assert plan(quantization="int4", huge_pages=False).reasons["weight memory"] == "as asked"
    # a host whose huge pages are off (the plan only reads the setting)
    monkeypatch.setattr(build_plan, "transparent_huge_pages", lambda: "never")
    off = plan(quantization="int4")
    assert not off.huge_pages and "never" in off.reasons["weight memory"]
    assert "the allocator's pages" in off.describe()
    with pytest.raises(ValueError, match="transparent huge pages"):
        plan(quantization="int4", huge_pages=True)


@pytest.mark.skipif(not THP, reason="transparent huge pages are off on this host")
def test_a_refused_placement_leaves_the_weights_where_they_are(tiny_dir, monkeypatch, caplog):
    """A kernel that refuses the mapping or the advice (it raises before any buffer moves) costs the speed-up only."""
    from llmserve.engine import model_runner

    def refuse(model):
        raise OSError(22, "Invalid argument")

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    placed = LLM(str(tiny_dir), quantization="int4", kv_cache_memory_gb=0.01, speculative_config="off")
    monkeypatch.setattr(model_runner, "place_on_huge_pages", refuse)
    refused = LLM(str(tiny_dir), quantization="int4", kv_cache_memory_gb=0.01, speculative_config="off")
    assert refused.engine.plan.huge_pages and "huge pages refused" in caplog.text
    storages = {t.untyped_storage().data_ptr() for t in _streamed(refused)}
    assert len(storages) == len(_streamed(refused))  # each its own allocation, as quantized
    prompts = [[5, 17, 99, 3, 250], [300, 301]]
    assert ([o.outputs[0].token_ids for o in refused.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in placed.generate(prompts, params, use_tqdm=False)])
