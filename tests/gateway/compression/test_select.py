"""Selection given fixed scores: which words go, within which budget, and what text is left."""

import math

import pytest

from llmserve.gateway.compression.protect import Spans, protected_spans
from llmserve.gateway.compression.select import Token, align, rebuild, select, words


def scored(text: str, pieces: list[tuple[str, float | None]]) -> list[Token]:
    return align(text, [p for p, _ in pieces], [None if lp is None else -lp for _, lp in pieces])


def test_align_spells_the_text_and_leaves_out_the_generated_token():
    text = "The cat sat."
    tokens = align(text, ["The", " cat", " sat", ".", "\n"], [None, -3.0, -1.0, -0.5, -2.0])
    assert [(t.start, t.end) for t in tokens] == [(0, 3), (3, 7), (7, 11), (11, 12)]
    assert tokens[0].info == math.inf and tokens[1].info == 3.0


def test_align_joins_the_byte_tokens_of_one_character():
    # what a byte-level BPE server echoes for " 日本": each byte token decodes alone to U+FFFD
    text = "a 日本 b"
    tokens = align(text, ["a", " \ufffd", "\ufffd", "\ufffd", "本", " b"], [None, -1.0, -2.0, -3.0, -4.0, -5.0])
    assert [(text[t.start:t.end], t.count, t.info) for t in tokens] == [
        ("a", 1, math.inf), (" 日", 3, 6.0), ("本", 1, 4.0), (" b", 1, 5.0)]


def test_align_skips_an_echoed_bos_and_refuses_tokens_that_do_not_spell_the_text():
    assert len(align("hi there", ["<s>", "hi", " there"], [None, -1.0, -2.0])) == 2
    with pytest.raises(ValueError):
        align("hi there", ["hi", " where"], [None, -1.0])
    with pytest.raises(ValueError):
        align("hi there", ["hi"], [None])


def test_words_start_at_whitespace_and_keep_layout_and_protected_spans():
    text = "Call get_user_id(x) now.\n\nThe end"
    toks = scored(text, [("Call", None), (" get", 1.0), ("_user", 1.0), ("_id", 1.0), ("(x)", 1.0), (" now", 0.1),
                         (".", 0.1), ("\n\n", 0.2), ("The", 0.3), (" end", 0.4)])
    ws = words(text, toks, protected_spans(text))
    assert [text[w.start:w.end] for w in ws] == ["Call", " get_user_id(x)", " now.", "\n\n", "The", " end"]
    assert [w.keep for w in ws] == [True, True, False, True, False, False]  # unscored, identifier, layout
    assert [w.tokens for w in ws] == [1, 4, 2, 1, 1, 1]


def test_select_drops_the_least_informative_words_first_until_the_budget_fits():
    text = "one two three four five six"
    infos = [None, 0.5, 9.0, 0.1, 4.0, 2.0]
    pieces = [(w if i == 0 else " " + w, lp) for i, (w, lp) in enumerate(zip(text.split(), infos, strict=True))]
    toks = scored(text, pieces)
    ws = words(text, toks, Spans([]))
    keep, kept = select([ws], budget=3)
    assert kept == 3
    assert rebuild(text, ws, keep[0]) == "one three five"  # dropped: four (0.1), two (0.5), six (2.0)
    keep, kept = select([ws], budget=6)
    assert kept == 6 and all(keep[0])


def test_select_shares_one_budget_across_texts_and_never_drops_protected_words():
    a, b = "x alpha beta", "y 2024 gamma"
    ws_a = words(a, scored(a, [("x", None), (" alpha", 5.0), (" beta", 6.0)]), Spans([]))
    ws_b = words(b, scored(b, [("y", None), (" 2024", 0.01), (" gamma", 0.5)]), protected_spans(b))
    keep, kept = select([ws_a, ws_b], budget=2)
    # the budget cannot be met: x, y (unscored) and 2024 (a number) stay, everything else goes
    assert kept == 3
    assert rebuild(a, ws_a, keep[0]) == "x" and rebuild(b, ws_b, keep[1]) == "y 2024"


def test_word_density_is_per_token():
    text = "a bcd e"
    ws = words(text, scored(text, [("a", None), (" b", 6.0), ("cd", 0.0), (" e", 2.5)]), Spans([]))
    assert [w.density for w in ws[1:]] == [3.0, 2.5]
    keep, _ = select([ws], budget=3)  # " bcd" holds 3 nats a token, " e" 2.5: " e" goes first
    assert rebuild(text, ws, keep[0]) == "a bcd"
