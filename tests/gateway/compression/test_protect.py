"""What compression must keep verbatim, found in the text."""

from llmserve.gateway.compression.protect import content_words, protected_spans


def kept(text: str, anchors: frozenset[str] = frozenset()) -> list[str]:
    spans = protected_spans(text, anchors)
    return [text[s:e] for s, e in zip(spans.starts, spans.ends, strict=True)]


def test_identifiers_numbers_urls_and_backticks_are_protected():
    text = ("Set max_tokens and userId, then call os.path.join in `main()`; it costs $3.50 (v1.2.3) "
            "- see https://example.org/docs?a=1 or mail ops@example.org about HttpClient")
    spans = kept(text)
    for needle in ("max_tokens", "userId", "os.path.join", "`main()`", "$3.50", "v1.2.3",
                   "https://example.org/docs?a=1", "ops@example.org", "HttpClient"):
        assert any(needle in s for s in spans), needle
    assert not any("Set" in s or "then call" in s for s in spans)


def test_straight_quotes_pair_in_order_and_long_quotes_are_prose():
    text = ('He said "yes" and left. Critics called it "a long and winding account of the whole affair that nobody '
            'asked for, written over many years by a committee of people who never agreed on anything at all" '
            'while she said "no".')
    spans = kept(text)
    assert '"yes"' in spans and '"no"' in spans
    assert not any("left" in s or "while she said" in s or "winding" in s for s in spans)


def test_code_lines_and_instructions_are_protected_whole():
    text = ("Some background prose about the weather.\n    total = price * count\nif (x > 1) {\n"
            "More prose here. Answer in one word. You must cite the source. The sky was grey.")
    spans = kept(text)
    assert "    total = price * count" in spans and "if (x > 1) {" in spans
    assert any("Answer in one word." in s for s in spans)
    assert any("You must cite the source." in s for s in spans)
    assert not any("weather" in s or "grey" in s for s in spans)


def test_the_questions_words_anchor_their_mentions_in_the_context():
    anchors = content_words("Who designed the reading room of the library?")
    assert anchors == {"designed", "reading", "room", "library"}
    spans = kept("Helen Marsh designed the Library and its Reading Room.", anchors)
    assert spans == ["designed", "Library", "Reading Room"] or spans == ["designed", "Library", "Reading", "Room"]
