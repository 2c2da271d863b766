"""What compression must never drop: the spans of a context that a low self-information score cannot vouch for.

A small LM finds `user_id` or `2.5` or a URL as predictable as a function word once it has seen it once, yet
dropping the second mention breaks a reference the answer may need. So identifiers, numbers, quoted strings,
URLs, code and instructions are kept verbatim whatever their score; only prose words compete for the budget.
"""

from __future__ import annotations

import re
from bisect import bisect_right

FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)  # a fenced block, or an unclosed one to the end
_SPANS = [
    FENCE,
    re.compile(r"`[^`\n]+`"),  # inline code
    re.compile(r"\b(?:https?|ftp)://\S+|\bwww\.\S+"),  # URLs
    re.compile(r"“[^”\n]{1,120}”|(?<!\w)'[^'\n]{1,80}'(?!\w)"),  # quoted strings (straight double quotes: below)
]
# identifiers, numbers and addresses are told by their characters, word by word: linear in the text, where
# regexes for them backtrack quadratically over a long unbroken string (a hash, a base64 blob)
_CHUNK = re.compile(r"\S+")
_EDGES = "\"'`.,;:!?()[]{}<>*“”‘’"
_CAMEL = re.compile(r"[a-z][A-Z]")  # camelCase, PascalCase with an inner capital (HttpClient)
_DOTTED = re.compile(r"\w\.\w")  # os.path.join, file.py, 1.2.3
# lines that read as code or data: keywords that open a statement, assignments, braces, JSON members, tables
_CODE_LINE = re.compile(
    r"^\s*(?:def |class |import |from \S+ import |return\b|#include|function |const |let |var |public |private |"
    r"if \(|for \(|while \(|elif |else:|try:|except\b|SELECT |INSERT |CREATE )"
    r"|^\s*[\w.\[\]]+\s*[+\-*/]?=\s*\S"  # x = 1, self.a += b
    r"|[{};]\s*$|^\s*[}\])]"  # a line that opens or closes a block, or ends a statement
    r'|^\s*"[^"\n]+"\s*:'  # a JSON member
    r"|^\s*\|.*\|\s*$",  # a table row
    re.M)
# an instruction: a sentence that starts with an imperative or speaks to the model
_IMPERATIVE = (r"answer|respond|reply|write|use|give|list|explain|summari[sz]e|translate|return|output|format|"
               r"keep|avoid|include|do|don't|never|always|be|make|ensure|follow|ignore|only|cite|provide|assume|"
               r"consider|remember|note|think|show|choose|pick|rate|classify|extract")
_INSTRUCTION = re.compile(rf"^(?:[-*•]\s*|\d+[.)]\s*)?(?:{_IMPERATIVE})\b"
                          r"|\byou (?:must|should|will|are|need|may|can(?:not)?|have to)\b|\byour (?:answer|"
                          r"response|reply|output|task|job|role)\b|\bplease\b|\bdo not\b|\bdon't\b|\bmake sure\b",
                          re.I)
MAX_QUOTE = 120  # longer quotes are prose, and compete like prose
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)", re.M)
_WORD = re.compile(r"[A-Za-z][\w-]{3,}")  # no apostrophe: "library's" anchors "Library"
STOPWORDS = frozenset(
    "about above after again against also although among another because been before being below between both "
    "could does doing down during each either enough even ever every from further have having here hers herself "
    "himself into itself just least less many might more most much must neither never none nothing once only "
    "other ours ourselves over same shall should since some such than that their theirs them themselves then "
    "there these they this those through under until upon very were what when where whether which while whom "
    "whose will with within without would your yours yourself yourselves".split())


def code_lines(text: str) -> list[tuple[int, int]]:
    """The spans of lines that read as code or structured data."""
    spans = []
    for m in _CODE_LINE.finditer(text):
        start = text.rfind("\n", 0, m.start()) + 1
        end = text.find("\n", m.end())
        spans.append((start, len(text) if end < 0 else end))
    return spans


def identifier_spans(text: str) -> list[tuple[int, int]]:
    """Words (edge punctuation aside) with a digit, an underscore, an @, an inner capital or an inner dot:
    numbers, amounts, dates, versions, snake_case, camelCase, dotted names, e-mail addresses."""
    spans = []
    for m in _CHUNK.finditer(text):
        word = m.group()
        core = word.strip(_EDGES)
        if core and (any(c.isdigit() for c in core) or "_" in core or "@" in core or _CAMEL.search(core)
                     or _DOTTED.search(core)):
            start = m.start() + word.index(core)
            spans.append((start, start + len(core)))
    return spans


def double_quoted(text: str) -> list[tuple[int, int]]:
    """Straight-quoted strings of up to MAX_QUOTE characters. Quotes pair in order within a line: a regex
    would pair a closing quote with the next opening one and protect the prose between them."""
    spans = []
    for line in re.finditer(r"[^\n]+", text):
        marks = [line.start() + i for i, c in enumerate(line.group()) if c == '"']
        spans += [(a, b + 1) for a, b in zip(marks[::2], marks[1::2], strict=False) if b - a <= MAX_QUOTE]
    return spans


def instruction_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _SENTENCE.finditer(text) if _INSTRUCTION.search(m.group().strip())]


def content_words(text: str) -> frozenset[str]:
    """The question's words worth finding again in the context (lower case, no stop words)."""
    return frozenset(w.lower() for w in _WORD.findall(text) if w.lower() not in STOPWORDS)


def protected_spans(text: str, anchors: frozenset[str] = frozenset()) -> Spans:
    """Every span of `text` to keep verbatim; `anchors`: words (lower case) kept wherever they occur, e.g. the
    question's, so the model can still find where the context speaks of what it is asked."""
    spans = [m.span() for pattern in _SPANS for m in pattern.finditer(text)]
    spans += identifier_spans(text) + code_lines(text) + instruction_spans(text) + double_quoted(text)
    if anchors:
        spans += [m.span() for m in _WORD.finditer(text) if m.group().lower() in anchors]
    return Spans(spans)


class Spans:
    """Sorted, merged character spans; `overlaps` in O(log n)."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for start, end in sorted(s for s in spans if s[1] > s[0]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect_right(self.starts, end - 1) - 1  # the last span starting before `end`
        return i >= 0 and self.ends[i] > start

    def __len__(self) -> int:
        return len(self.starts)
