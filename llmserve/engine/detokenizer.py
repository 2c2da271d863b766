"""Incremental detokenization with stop strings.

Tokens are turned into text with `tokenizers`' DecodeStream, which buffers a token that ends in
the middle of a multi-byte UTF-8 character until the character is complete. Stop strings are
searched only in the newly added text (plus the overlap a stop string could straddle); the text
shown while running holds back the last `len(longest stop) - 1` characters, so a stop string is
never leaked to a streaming client before it is recognised and cut.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers.convert_slow_tokenizer import bytes_to_unicode

# A few prompt tokens give the decoder the context that decides a leading space (SentencePiece).
_PROMPT_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,  # a `tokenizers.Tokenizer`
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(
            ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], skip_special_tokens=skip_special_tokens
        )
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.finished = False
        self._taken = 0  # characters of output_text already handed out by take_text

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token; returns the stop string that ended the text, if one did."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        if not (check_stop and self._stop):
            return None
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[: index + (len(stop) if self._include_stop else 0)]
        self.finished = True
        return stop

    def finish(self) -> None:
        self.finished = True

    def take_text(self) -> str:
        """The text safe to show that was not taken yet (outputs are deltas). A stop string only ever cuts
        text that was held back, so what was taken stays a prefix of the final text."""
        text = self.output_text
        new, self._taken = text[self._taken :], len(text)
        return new

    @property
    def output_text(self) -> str:
        """Text that is safe to show now: all of it once finished, else minus the stop-string holdback."""
        if self.finished or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]


class TokenBytes:
    """Each token's own bytes, for the `bytes` of OpenAI's chat logprobs.

    A token can end inside a multi-byte UTF-8 character: its decoded text is then U+FFFD, and only the
    bytes of consecutive tokens, joined, rebuild the text. The vocabulary's strings hold those bytes:
    byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) spells each byte as one printable character, and
    SentencePiece vocabularies spell a lone byte `<0xHH>` and a space `▁`. Built on first use.
    """

    def __init__(self, tokenizer) -> None:  # a `tokenizers.Tokenizer`
        self._tokenizer = tokenizer
        self._table: list[bytes] | None = None

    def __getitem__(self, token_id: int) -> bytes:
        if self._table is None:
            self._table = self._build()
        return self._table[token_id]

    def _build(self) -> list[bytes]:
        tokenizer = self._tokenizer
        if "ByteLevel" in str(tokenizer.decoder):
            byte_of = {ch: b for b, ch in bytes_to_unicode().items()}  # GPT-2's byte alphabet
            spell = lambda s: bytes(byte_of[ch] for ch in s) if all(ch in byte_of for ch in s) else s.encode()
        else:
            spell = _sentencepiece_bytes
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        return [spell(tokenizer.id_to_token(i) or "") for i in range(size)]


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode()
