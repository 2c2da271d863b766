"""Token counting for the load generator: exact with the model's tokenizer, approximate without one.

Why a separate module: prompt sizing (workload) and streamed-token accounting (client) must agree on
one counter, and the bench must never need the engine (nor torch) to count. With `--tokenizer` we use
the Rust `tokenizers` library directly (tokenizer.json) plus the model's Jinja chat template, so the
counted prompt is what a chat server will actually see; `transformers` is only a last resort for a
hub name or a directory without tokenizer.json, and always offline (HF_HUB_OFFLINE).

Without a tokenizer every count is an approximation (one token per word or punctuation mark): callers
must surface `TokenCounter.exact == False` to the user.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Message = dict[str, str]

_APPROX_RE = re.compile(r"\w+|[^\w\s]")


class TokenizerLoadError(RuntimeError):
    """The tokenizer named by --tokenizer could not be loaded offline."""


@dataclass
class TokenCounter:
    """Counts tokens of text and chat prompts; `exact` tells whether counts come from a real tokenizer.

    encode: text -> list of (start, end) character offsets of its tokens (no special tokens added).
    template: renders chat messages (with the generation prompt) to the text the server tokenizes.
    """

    description: str
    exact: bool
    encode: Callable[[str], list[tuple[int, int]]]
    template: Callable[[Sequence[Message]], str] | None = None
    notes: list[str] = field(default_factory=list)

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    def count_prompt(self, messages: Sequence[Message], chat: bool = True) -> int:
        """Prompt tokens as the server should count them: chat-templated when a template is known."""
        if chat and self.template is not None:
            try:
                return self.count(self.template(messages))
            except Exception:  # noqa: BLE001 - a template needing unknown globals: fall back, said in notes
                self.template = None
                self.notes.append("chat template failed to render; prompt lengths exclude template tokens")
        return self.count(messages_to_text(messages))

    def tokens_per_piece(self, pieces: Sequence[str]) -> list[int]:
        """How many tokens of the concatenated text are completed inside each piece (stream chunk).

        The full text is tokenized once; a token belongs to the piece holding its last character,
        i.e. the chunk at whose arrival the token became visible.
        """
        if not pieces:
            return []
        ends: list[int] = []
        pos = 0
        for p in pieces:
            pos += len(p)
            ends.append(pos)
        counts = [0] * len(pieces)
        for start, end in self.encode("".join(pieces)):
            if end <= start:
                continue
            idx = min(bisect.bisect_left(ends, end), len(pieces) - 1)
            counts[idx] += 1
        return counts


def messages_to_text(messages: Sequence[Message]) -> str:
    """Plain-text rendering of chat messages (for /v1/completions and template-less counting)."""
    return "\n\n".join(m.get("content", "") for m in messages)


def approximate_counter() -> TokenCounter:
    """One token per word or punctuation mark: close for common English words, low for rare ones."""

    def encode(text: str) -> list[tuple[int, int]]:
        return [(m.start(), m.end()) for m in _APPROX_RE.finditer(text)]

    return TokenCounter(
        description="approximate (no tokenizer: 1 word or punctuation mark = 1 token)",
        exact=False,
        encode=encode,
        template=None,
    )


def _special(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _jinja_template(source: str, config: dict[str, Any]) -> Callable[[Sequence[Message]], str]:
    """Compile a HF chat template the way transformers renders it (sandboxed Jinja, same flags)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(source)
    specials = {k: _special(v) for k, v in config.items() if k.endswith("_token")}

    def render(messages: Sequence[Message]) -> str:
        return compiled.render(messages=list(messages), add_generation_prompt=True, **specials)

    return render


def _template_from_dir(directory: Path) -> tuple[Callable[[Sequence[Message]], str] | None, str]:
    config: dict[str, Any] = {}
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
    source: str | None = None
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        source = jinja_path.read_text(encoding="utf-8")
    else:
        tmpl = config.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if isinstance(tmpl, str):
            source = tmpl
    if source is None:
        return None, "no chat template found: chat prompt lengths exclude template tokens"
    try:
        return _jinja_template(source, config), "chat template from the tokenizer files"
    except Exception as exc:  # noqa: BLE001 - a template jinja cannot compile: count without it
        return None, f"chat template did not compile ({exc}); chat prompt lengths exclude template tokens"


def _from_tokenizer_json(path: Path, label: str) -> TokenCounter:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))

    def encode(text: str) -> list[tuple[int, int]]:
        return list(tok.encode(text, add_special_tokens=False).offsets)

    template, note = _template_from_dir(path.parent)
    return TokenCounter(
        description=f"exact ({label})", exact=True, encode=encode, template=template, notes=[note]
    )


def _from_transformers(name: str) -> TokenCounter:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means "not available offline"
        raise TokenizerLoadError(f"cannot load tokenizer {name!r} offline: {exc}") from exc

    def encode(text: str) -> list[tuple[int, int]]:
        if getattr(tok, "is_fast", False):
            return list(tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])
        ids = tok(text, add_special_tokens=False)["input_ids"]  # slow tokenizer: no offsets, spread evenly
        n = max(len(text), 1)
        return [(i * n // max(len(ids), 1), (i + 1) * n // max(len(ids), 1)) for i in range(len(ids))]

    template = None
    if getattr(tok, "chat_template", None):

        def template(messages: Sequence[Message]) -> str:
            return str(tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True))

    note = "chat template via transformers" if template else "no chat template: prompt lengths exclude it"
    return TokenCounter(description=f"exact ({name}, transformers)", exact=True, encode=encode,
                        template=template, notes=[note])


def load_token_counter(spec: str | None) -> TokenCounter:
    """Load `--tokenizer` (tokenizer.json file, model directory, or cached hub name), offline only.

    spec None -> the approximate counter. Raises TokenizerLoadError when spec is given but unusable,
    so that a typo is not silently turned into approximate counts.
    """
    if not spec:
        return approximate_counter()
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        try:
            return _from_tokenizer_json(path, path.name)
        except Exception as exc:  # noqa: BLE001
            raise TokenizerLoadError(f"cannot read tokenizer file {path}: {exc}") from exc
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _from_tokenizer_json(path / "tokenizer.json", str(path))
        return _from_transformers(str(path))
    # a hub name: only what is already in the local cache
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(spec, local_files_only=True))
        if (local / "tokenizer.json").is_file():
            return _from_tokenizer_json(local / "tokenizer.json", spec)
    except Exception:  # noqa: BLE001 - not cached, or no huggingface_hub: try transformers below
        pass
    return _from_transformers(spec)
