"""The engine's one seam for structured outputs: grammars compiled once, token masks computed per step.

llguidance turns a constraint into a matcher over the model's tokenizer. It was chosen over xgrammar
(docs/performance.md, "Structured outputs"): it compiles every schema far faster (xgrammar is slowest on length-bounded
strings), it refuses the JSON Schema keywords it cannot enforce instead of ignoring them, it never lets a special
token into a JSON string, and it needs no other package. Its masks cost far less than a decode step
(docs/performance.md, "Structured outputs"). The manager owns:
- the tokenizer's index, built once in a background thread, started by the first constraint or
  by `prepare()` (the server calls it at start). Added tokens the tokenizer treats as text (Qwen's `<tool_call>`
  and `</tool_call>`) are text to the grammar too: llguidance's own reader marks every added token special, so a
  grammar that writes the tag as text would let the tag's token through its mask and then refuse it;
- compiled matchers by constraint: a constraint is compiled (or refused with its reason) once, off the
  engine's lock, on one low-priority thread (a flood of large schemas queues there instead of taking the
  cores from decoding), within a size budget; each request gets a copy of the compiled matcher (microseconds).
  A compiled constraint is tried on its first token, so one that no text satisfies, or that hits a limit of the
  library at once, is refused before it is queued;
- per step, `bitmasks`: for every constrained request that samples, the allowed tokens of each of its sampling
  rows (its next token, and the token after each of its proposal tokens) as int32 bitmasks, one bit per token,
  that the sampler applies to the logits;
- `filter_proposals`: a speculative proposal is cut at its first token the grammar refuses, so no step is
  spent verifying a token that cannot be kept.
A request's own matcher advances as its tokens are appended (`Request.append_token`); once the grammar is
complete the request stops there, without a step for the EOS token. A matcher that fails while decoding (a limit
of the library reached mid-output) ends its request with an error, never as a stop.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from copy import copy

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
# A constraint's text above this is refused before compiling: compile time grows faster than the size (a 174 KB
# schema of flat string fields takes 0.5 s on one core, 350 KB 2 s, a 1 MB one panics inside the library after
# seconds). OpenAI's own limit on a schema's strings is 120,000 characters.
MAX_CONSTRAINT_BYTES = 128 * 1024
# How long the server waits for a compile (queue included) before it answers 400; the compile itself finishes
# on its thread and is cached either way.
COMPILE_BUDGET_S = 2.0
COMPILE_NICENESS = 10  # the compile thread's scheduling priority below the engine's (Linux threads)


class GrammarError(ValueError):
    """A constraint that cannot be compiled (invalid, unsupported, unsatisfiable or over a limit), with the
    reason."""


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: object, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer")
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile", initializer=_lower_priority)
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        # by constraint: its compiled matcher, or the error it was refused with (asked again, refused at once)
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher | GrammarError] = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Start building the tokenizer's index in the background, if nothing has yet."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(_tokenizer_index, self._hf_tokenizer, self.vocab_size,
                                                    self._eos_token_ids)

    def compile(self, spec: StructuredOutputsParams) -> None:
        """Compile a constraint now (cached); GrammarError with the reason when it cannot be."""
        self._compiled_matcher(spec)

    def index(self) -> Future[llguidance.LLTokenizer]:
        """The tokenizer's index (built once, in the background): what every compile waits for first."""
        self.prepare()
        return self._tokenizer

    def submit(self, spec: StructuredOutputsParams) -> Future[None]:
        """`compile` on the low-priority compile thread (the server waits for it up to COMPILE_BUDGET_S)."""
        return self._compile_pool.submit(self._compiled_matcher, spec)

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
            if matcher.is_error():  # failed while decoding: whatever is sampled ends the request with the error
                masks[start] = -1
                continue
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
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
        if found is None:
            try:
                found = self._compile(spec)
            except GrammarError as e:
                found = e
            with self._lock:
                self._compiled[key] = found
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        kind, text = spec.key
        name = _KIND_NAMES[kind]
        if len(text.encode()) > MAX_CONSTRAINT_BYTES:
            raise GrammarError(f"{name}: {len(text.encode()) // 1024} KiB, over the {MAX_CONSTRAINT_BYTES // 1024} KiB "
                               "a constraint may take")
        grammar = _grammar(spec)
        self.prepare()
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)  # drops the GIL
        if matcher.is_error():
            raise GrammarError(f"{name}: {constraint_failure(matcher)}")
        problem = self._first_token_problem(matcher)
        if problem is not None:
            raise GrammarError(f"{name}: {problem}")
        return matcher

    def _first_token_problem(self, matcher: llguidance.LLMatcher) -> str | None:
        """Why a fresh matcher cannot produce an output, found by trying its first token on a copy: none is
        allowed (no text satisfies the constraint), or a limit of the library is hit at once (a regex whose
        automaton is too large, a rule with too many alternatives)."""
        probe = matcher.deep_copy()
        mask = np.zeros((1, self.mask_words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(probe, mask, 0)
        if probe.is_error():
            return constraint_failure(probe)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size])
        text = np.setdiff1d(allowed, self._eos_token_ids)  # a regex like `.*` allows the whole vocabulary
        if not text.size:
            return None if probe.is_accepting() else "no text satisfies it"
        if not probe.consume_token(int(text[0])) or probe.is_error():
            return constraint_failure(probe)
        return None


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
        if kind == "choice":  # one terminal, not a rule of alternatives: rules are limited to 2,000 items a row
            return llguidance.LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(_lark_string(c) for c in spec.choice))
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    except ValueError as e:
        raise GrammarError(f"{_KIND_NAMES[kind]}: {e}") from None


def constraint_failure(matcher: llguidance.LLMatcher) -> str:
    """A failed matcher's reason on one line: the library's error without its state dump or backtrace."""
    error = matcher.get_error() or matcher.stop_reason()
    for dump in ("<state>", "<backtrace>", "stack backtrace"):
        error = error.split(dump, 1)[0]
    error = " ".join(error.split())
    if error.startswith("NoExtension"):
        return "no text satisfies it"
    if error.startswith("panic:"):
        return f"the grammar library failed on it ({error.removeprefix('panic:').strip()})"
    return error[:500]


def _tokenizer_index(hf_tokenizer: object, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's index of the tokenizer, with added tokens the tokenizer treats as text (special=False)
    given their text's bytes, and text tokenized with special tokens' names read as plain text."""
    index = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
    added = getattr(hf_tokenizer, "added_tokens_decoder", {})
    as_text = {i: token.content for i, token in added.items() if not token.special and i < vocab_size}
    if not as_text:
        return index
    tokens = [index.decode_bytes([i]) for i in range(vocab_size)]
    for i, content in as_text.items():
        tokens[i] = content.encode()
    view = _TokenizerView(hf_tokenizer, tokens, [i for i, token in added.items() if token.special],
                          eos_token_ids[0])
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=vocab_size, eos_token=eos_token_ids)


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the special ones' ids, and a tokenize call
    (on its own copy of the fast tokenizer, so the engine's own tokenizer keeps reading special tokens)."""

    bos_token_id = None

    def __init__(self, hf_tokenizer: object, tokens: list[bytes], special_token_ids: list[int], eos: int) -> None:
        self.tokens, self.special_token_ids, self.eos_token_id = tokens, special_token_ids, eos
        self._backend = copy(hf_tokenizer.backend_tokenizer)
        self._backend.no_padding()
        self._backend.no_truncation()
        self._backend.encode_special_tokens = True  # the text "<|im_end|>" in a grammar is text

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # the wrapper then passes str
        return self._backend.encode(text, add_special_tokens=False).ids


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)  # this thread only, on Linux
    except (AttributeError, OSError):
        pass


def _lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)
