"""A lexical guard on semantic hits: two questions close in meaning still must not differ in the words that
change the answer.

Embeddings place "Track order 48213" and "Track order 48231" at cosine 0.99, and "Is the clinic open on
Sundays?" beside "Is the clinic open on Saturdays?"; no threshold separates them from true rewordings
(docs/performance.md, "The gateway"; `benchmarks/gateway.py --parts threshold`). So a semantic hit also
needs the same numbers, the same negations, and the same names (capitalised words past the first, plural 's'
aside). Cheap, and it removes the false hits users complain about most at the cost of some missed ones (a
reworded name).
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[A-Za-z][A-Za-z'’]*|\d+(?:[.,:/-]\d+)*%?")
_NEGATIONS = frozenset({"not", "no", "never", "none", "nor", "without", "cannot", "nothing", "nobody", "neither"})
_SENTENCE_END = re.compile(r"[.!?]\s+")


def critical_words(text: str) -> tuple[frozenset[str], int, frozenset[str]]:
    """(numbers, negation count, names) of a question."""
    numbers: set[str] = set()
    names: set[str] = set()
    negations = 0
    for sentence in _SENTENCE_END.split(text):
        for i, match in enumerate(_WORD.finditer(sentence)):
            word = match.group().replace("’", "'")
            lower = word.lower()
            if word[0].isdigit():
                numbers.add(word.rstrip("%") + ("%" if word.endswith("%") else ""))
            elif lower in _NEGATIONS or lower.endswith("n't"):
                negations += 1
            elif i > 0 and word[0].isupper() and word != "I" and not word.startswith("I'"):
                names.add(lower.removesuffix("'s").removesuffix("s"))
    return frozenset(numbers), negations, frozenset(names)


def compatible(a: str, b: str) -> bool:
    """True when `b` may be answered with `a`'s answer as far as numbers, negations and names go."""
    return critical_words(a) == critical_words(b)
