"""Incremental detokenization: multi-byte characters and stop strings that straddle tokens."""

from __future__ import annotations

from llmserve.engine.detokenizer import IncrementalDetokenizer, TokenBytes

TEXT = "Grüße aus Köln — 你好世界 🙂👍 naïve café"


def _backend(llm_fp32):
    return llm_fp32.engine._backend_tokenizer


def test_incremental_text_equals_full_decode_for_multibyte_utf8(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(_backend(llm_fp32), tok.encode("Say:"), stop=[])
    seen = []
    for t in ids:
        detok.append(t)
        seen.append(detok.output_text)
        assert "\ufffd" not in detok.output_text  # never a half character
    assert detok.output_text == tok.decode(ids) == TEXT
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))  # text only ever grows


def test_token_bytes_rebuild_the_text_where_tokens_split_characters(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    ids = tok.encode(TEXT + "<|im_end|>")
    token_bytes = TokenBytes(_backend(llm_fp32))
    pieces = [token_bytes[t] for t in ids]
    assert b"".join(pieces).decode() == TEXT + "<|im_end|>"
    split = [t for t, p in zip(ids, pieces, strict=True) if not _is_utf8(p)]
    assert split, "the text must hold characters that tokens split"
    assert "\ufffd" in tok.decode([split[0]])  # such a token's own text cannot say which bytes it holds


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_stop_string_across_tokens_is_cut_and_never_shown(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    ids = tok.encode("alpha beta gamma delta epsilon")
    detok = IncrementalDetokenizer(_backend(llm_fp32), [], stop=["ma del"])
    shown = []
    stop = None
    for t in ids:
        stop = detok.append(t)
        shown.append(detok.output_text)
        if stop:
            break
    assert stop == "ma del"
    assert detok.output_text == "alpha beta gam"
    assert all("ma del" not in s and "ma d" not in s for s in shown)
