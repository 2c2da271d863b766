"""Incremental detokenization with stop strings.

Tokens are turned into text with `tokenizers`' DecodeStream, which buffers a token that ends in
the middle of a multi-byte UTF-8 character until the character is complete. Stop strings are
searched only in the newly added text (plus the overlap a stop string could straddle); the text
shown while running holds back the last `len(longest stop) - 1` characters, so a stop string is
never leaked to a streaming client before it is recognised and cut.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

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

    @property
    def output_text(self) -> str:
        """Text that is safe to show now: all of it once finished, else minus the stop-string holdback."""
        if self.finished or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]
