"""The engine's one seam for structured outputs: grammars compiled once, token masks computed per step.

llguidance turns a constraint into a matcher over the model's tokenizer. It was chosen over xgrammar
(docs/performance.md, "Structured outputs"): it compiles every schema far faster (xgrammar is slowest on length-bounded
strings), it refuses the JSON Schema keywords it cannot enforce instead of ignoring them, it never lets a special
token into a JSON string, and it needs no other package. Its masks cost far less than a decode step
(docs/performance.md, "Structured outputs"). The manager owns:
- the tokenizer's index, built once in a background thread, started by the first constraint or
  by `prepare()` (the server calls it at start);
- compiled matchers by constraint: a constraint is compiled (or refused with its reason) once, off the
  engine's lock, and each request gets a copy of the compiled matcher (microseconds);
- per step, `bitmasks`: for every constrained request that samples, the allowed tokens of each of its sampling
  rows (its next token, and the token after each of its proposal tokens) as int32 bitmasks, one bit per token,
  that the sampler applies to the logits;
- `filter_proposals`: a speculative proposal is cut at its first token the grammar refuses, so no step is
  spent verifying a token that cannot be kept.
A request's own matcher advances as its tokens are appended (`Request.append_token`); once the grammar is
complete the request stops there, without a step for the EOS token.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from llmserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
# JSON is written without a bound on whitespace by default; a small model can then loop on newlines forever.
# A run of whitespace is bounded instead: enough for an indented, pretty-printed document.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


class GrammarError(ValueError):
    """A constraint that cannot be compiled (invalid or unsupported), with the grammar library's reason."""


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: object, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer")
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Start building the tokenizer's index in the background, if nothing has yet."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(llguidance.hf.from_tokenizer, self._hf_tokenizer,
                                                    n_vocab=self.vocab_size, eos_token=self._eos_token_ids)

    def compile(self, spec: StructuredOutputsParams) -> None:
        """Compile a constraint now (cached); GrammarError with the reason when it cannot be. Call it off the
        engine's lock: a large schema takes milliseconds, an extreme grammar up to a second."""
        self._compiled_matcher(spec)

    def new_matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher of this constraint for one request."""
        return self._compiled_matcher(spec).deep_copy()

    def filter_proposals(self, proposals: dict[str, list[int]], matchers: dict[str, llguidance.LLMatcher]
                         ) -> dict[str, list[int]]:
        """Each constrained request's proposal cut before its first token the grammar refuses."""
        out = {}
        for request_id, draft in proposals.items():
            matcher = matchers.get(request_id)
            if matcher is not None:
                draft = draft[: matcher.validate_tokens(draft)]
            if draft:
                out[request_id] = draft
        return out

    def bitmasks(self, rows: list[tuple[str, llguidance.LLMatcher, list[int]]]) -> dict[str, np.ndarray]:
        """For each (request id, matcher, proposal tokens): the allowed tokens at its next position and after
        each proposal token, an int32 array [1 + len(proposal), mask_words], bit t of word t // 32 set where
        token t is allowed. The matchers end as they began."""
        if not rows:
            return {}
        starts = np.cumsum([0] + [1 + len(draft) for _, _, draft in rows])
        masks = np.full((int(starts[-1]), self.mask_words), -1, dtype=np.int32)  # rows past a refused token: all
        # row by row: llguidance's parallel executor was slower than this on 2 cores for a batch of 8
        for (_, matcher, draft), start in zip(rows, starts, strict=False):
            llguidance.numpy.fill_next_token_bitmask(matcher, masks, int(start))
            if draft:
                n = matcher.validate_tokens(draft)  # filter_proposals already cut the rest
                for j, token in enumerate(draft[:n]):
                    matcher.consume_token(token)
                    llguidance.numpy.fill_next_token_bitmask(matcher, masks, int(start) + j + 1)
                matcher.rollback(n)
        return {request_id: masks[starts[i]: starts[i + 1]] for i, (request_id, _, _) in enumerate(rows)}

    def _compiled_matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = spec.key
        with self._lock:
            matcher = self._compiled.get(key)
            if matcher is not None:
                self._compiled.move_to_end(key)
                return matcher
        grammar = _grammar(spec)
        self.prepare()
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)  # drops the GIL
        if matcher.is_error():
            raise GrammarError(f"{_KIND_NAMES[key[0]]}: {matcher.get_error()}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher


_KIND_NAMES = {"json": "the JSON schema", "json_object": "JSON object", "regex": "the regex",
               "choice": "the choices", "grammar": "the grammar"}


def _grammar(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a constraint."""
    kind, _ = spec.key
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(_lark_string(c) for c in spec.choice))
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    except ValueError as e:
        raise GrammarError(f"{_KIND_NAMES[kind]}: {e}") from None


def _lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)
