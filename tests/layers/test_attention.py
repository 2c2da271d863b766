"""Decode grouping of the PyTorch attention path: which decodes share one padded attention batch."""

from __future__ import annotations

from llmserve.layers.attention.torch_ops import GROUP_OVERHEAD_BLOCKS, decode_groups


def test_similar_lengths_share_one_group():
    assert decode_groups([3, 3, 4, 5, 6]) == [(0, 5)]
    assert decode_groups([]) == []


def test_one_long_context_gets_its_own_group():
    # 16 decodes at 13 blocks beside one at 125: one padded group would gather 17 * 125 blocks
    assert decode_groups([13] * 16 + [125]) == [(0, 16), (16, 17)]


def test_groups_minimise_padding_plus_overhead():
    lengths = [1, 2, 2, 40, 41, 200]
    groups = decode_groups(lengths)
    assert groups == [(0, 3), (3, 5), (5, 6)]

    def cost(gs):
        return sum(GROUP_OVERHEAD_BLOCKS + (e - s) * lengths[e - 1] for s, e in gs)

    # exhaustive check against every contiguous split
    n = len(lengths)
    best = min(
        cost([(s, e) for s, e in zip([0, *cuts], [*cuts, n], strict=True)])
        for mask in range(1 << (n - 1))
        for cuts in [[i + 1 for i in range(n - 1) if mask >> i & 1]]
    )
    assert cost(groups) == best


def test_batched_correctness_prompts_span_several_groups(prompt_token_ids):
    # tests/engine/test_correctness.py's batched run must exercise more than one decode group
    blocks = sorted(-(-(len(ids) + 1) // 16) for ids in prompt_token_ids)
    assert len(decode_groups(blocks)) > 1


def test_the_plan_takes_the_first_registered_backend_that_can_run_and_says_why_it_passed_others():
    from llmserve.layers.attention import ATTENTION_BACKENDS, choose_attention

    assert list(ATTENTION_BACKENDS) == ["native", "torch"]  # the order of preference
    reasons: dict[str, str] = {}
    assert choose_attention("cpu", True, reasons) == "native" and "attention" not in reasons
    assert choose_attention("cpu", False, reasons) == "torch" and "not built" in reasons["attention"]
    assert choose_attention("cuda:0", True, reasons) == "torch" and "a CPU kernel" in reasons["attention"]
