#!/usr/bin/env python3
"""llguidance vs xgrammar, measured on this CPU, to pick the constrained-decoding backend for structured outputs
(OpenAI `response_format` json_object / json_schema, vLLM guided_choice / regex / json / grammar).

    .venv/bin/pip install --no-deps llguidance==1.9.1 xgrammar==0.2.8 apache-tvm-ffi   # + jsonschema
    .venv/bin/python benchmarks/grammar_backends.py                 # both tokenizers, ~4 min
    .venv/bin/python benchmarks/grammar_backends.py --tokenizers smollm2-135m --rounds 2

Both libraries run in one process, alternated (ABAB / BABA per round), so compare ratios, not absolute
figures (2 shared cores, noisy). Parts: tokenizer-info build; grammar compile (cold and cached) and first
mask; per-token bitmask cost along a valid document (plus advance and rollback); applying a bitmask to
float32 logits [1|8, vocab]; batched masks for 8 requests; JSON Schema feature coverage (valid instance
accepted, violating instance refused); a masked random-logits walk checked with `jsonschema`; whether the
calls release the GIL. Tokenizers come from llmserve's own loader (the GGUF-embedded ones). Writes
benchmarks/results/grammar_backends.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch as llg_torch
import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve.loader import load_tokenizer  # noqa: E402

LIBS = ("llguidance", "xgrammar")


# ----------------------------------------------------------------------------------------------------------
# Workloads: (name, kind, spec, a valid instance as text)
# ----------------------------------------------------------------------------------------------------------


class LineItem(BaseModel):
    sku: str
    quantity: int = Field(ge=1, le=100)
    price: float
    tags: list[str] = []


class Address(BaseModel):
    street: str
    city: str
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Order(BaseModel):
    order_id: int
    customer: str
    status: Literal["new", "paid", "shipped"]
    shipping: Address
    items: list[LineItem]
    note: str | None = None


SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "title": {"type": "string"},
        "status": {"enum": ["draft", "published", "archived"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "author": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                   "required": ["name"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number"}},
        "published": {"type": "boolean"},
    },
    "required": ["id", "title", "status", "author"],
    "additionalProperties": False,
}
_POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
          "required": ["x", "y"], "additionalProperties": False}
REFS_ANYOF = {
    "$defs": {
        "point": _POINT,
        "circle": {"type": "object", "properties": {"kind": {"const": "circle"}, "center": {"$ref": "#/$defs/point"},
                                                    "r": {"type": "number"}},
                   "required": ["kind", "center", "r"], "additionalProperties": False},
        "polygon": {"type": "object", "properties": {"kind": {"const": "polygon"},
                                                     "points": {"type": "array", "items": {"$ref": "#/$defs/point"}}},
                    "required": ["kind", "points"], "additionalProperties": False},
    },
    "type": "object",
    "properties": {"shapes": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/circle"},
                                                                   {"$ref": "#/$defs/polygon"}]}}},
    "required": ["shapes"],
    "additionalProperties": False,
}
STRINGS = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                   "nickname": {"type": "string", "minLength": 3, "maxLength": 12},
                   "comment": {"type": "string", "maxLength": 40}},
    "required": ["code", "nickname", "comment"],
    "additionalProperties": False,
}
MAXLEN = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 200}},
          "required": ["summary"], "additionalProperties": False}
INTS = {
    "type": "object",
    "properties": {"port": {"type": "integer", "minimum": 1, "maximum": 65535},
                   "retries": {"type": "integer", "minimum": 0, "maximum": 10},
                   "offset": {"type": "integer", "minimum": -50, "maximum": 50}},
    "required": ["port", "retries", "offset"],
    "additionalProperties": False,
}
ORDER_INSTANCE = Order(order_id=1042, customer="Ada Lovelace", status="paid",
                       shipping=Address(street="12 Analytical Way", city="London", zip="90210"),
                       items=[LineItem(sku="AB-1", quantity=2, price=19.99, tags=["gift"]),
                              LineItem(sku="ZX-9", quantity=1, price=5.5)],
                       note=None)
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9]+
"""
CHOICES = ["positive", "negative", "neutral"]

WORKLOADS: list[tuple[str, str, Any, str]] = [
    ("small_object", "json_schema", SMALL, json.dumps({"name": "Ada Lovelace", "age": 36})),
    ("nested_arrays_enum", "json_schema", NESTED, json.dumps(
        {"id": 7, "title": "Structured outputs", "status": "published", "tags": ["llm", "json"],
         "author": {"name": "Grace", "email": "grace@example.com"}, "scores": [0.5, 1.25], "published": True})),
    ("ref_defs_anyof", "json_schema", REFS_ANYOF, json.dumps(
        {"shapes": [{"kind": "circle", "center": {"x": 0, "y": 1.5}, "r": 2},
                    {"kind": "polygon", "points": [{"x": 0, "y": 0}, {"x": 1, "y": 0}, {"x": 0, "y": 1}]}]})),
    ("string_pattern_len", "json_schema", STRINGS, json.dumps(
        {"code": "ABC-1234", "nickname": "ada", "comment": "short note"})),
    ("string_maxlen_200", "json_schema", MAXLEN, json.dumps({"summary": "A short summary of the ticket."})),
    ("int_min_max", "json_schema", INTS, json.dumps({"port": 8080, "retries": 3, "offset": -12})),
    ("pydantic_order", "json_schema", Order.model_json_schema(), json.dumps(ORDER_INSTANCE.model_dump())),
    ("json_object", "json_object", None, json.dumps(
        {"model": "smollm2", "ok": True, "n": [1, 2, 3], "meta": {"x": None, "y": "z"}})),
    ("regex", "regex", r"\d{3}-\d{4}", "555-1234"),
    ("choice", "choice", CHOICES, "neutral"),
    ("lark_arith", "lark", LARK, "(12+3)*4-5/6"),
    ("gbnf_arith", "gbnf", GBNF, "(12+3)*4-5/6"),
]
SCHEMAS = {name: spec for name, kind, spec, _ in WORKLOADS if kind == "json_schema"}
SCHEMAS["json_object"] = {"type": "object"}


# ----------------------------------------------------------------------------------------------------------
# The two backends behind one small interface
# ----------------------------------------------------------------------------------------------------------


class LLG:
    """llguidance: the compiled artefact is an untouched LLMatcher (a template); a request gets deep_copy()."""

    name = "llguidance"

    def __init__(self, hf_tok, vocab: int, stop_ids: list[int]):
        self.vocab = vocab
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=stop_ids)

    def grammar(self, kind: str, spec: Any, compact: bool = False) -> str:
        if kind == "json_schema":
            opts = {"whitespace_flexible": False} if compact else None
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=opts)
        if kind == "json_object":
            return self.grammar("json_schema", {"type": "object"}, compact)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(spec))
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec)
        if kind == "gbnf":
            return llguidance.grammar_from("gbnf", spec)
        raise ValueError(kind)

    def compile(self, kind: str, spec: Any, compact: bool = False):
        m = llguidance.LLMatcher(self.tok, self.grammar(kind, spec, compact), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def compile_cached(self, kind: str, spec: Any, template):
        return template.deep_copy()  # llguidance has no grammar cache: caching = keeping the template

    def clear_cache(self) -> None:
        pass

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask: torch.Tensor, row: int = 0) -> None:
        llg_torch.fill_next_token_bitmask(m, bitmask, row)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, k: int) -> None:
        m.rollback(k)

    def finished(self, m) -> bool:
        return m.is_stopped()

    def accepting(self, m) -> bool:
        return m.is_accepting()

    def error(self, m) -> str:
        return m.get_error()


class XGR:
    """xgrammar: GrammarCompiler (with its cache) -> CompiledGrammar -> GrammarMatcher per request."""

    name = "xgrammar"

    def __init__(self, hf_tok, vocab: int, stop_ids: list[int]):
        self.vocab = vocab
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab, stop_token_ids=stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)

    def compile(self, kind: str, spec: Any, compact: bool = False, compiler=None):
        c = compiler or self.compiler
        seps = (",", ":") if compact else None  # xgrammar's default is (", ", ": "); llguidance's "," ":"
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=not compact, separators=seps)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=not compact, separators=seps)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":  # no native choice: an EBNF alternation, as vLLM does
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        if kind == "lark":
            return c.compile_lark(spec)
        if kind == "gbnf":
            return c.compile_grammar(spec)
        raise ValueError(kind)

    def compile_cached(self, kind: str, spec: Any, template):
        return self.compile(kind, spec)

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, compiled):
        return xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor, row: int = 0) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, k: int) -> None:
        m.rollback(k)

    def finished(self, m) -> bool:
        return m.is_terminated()

    def accepting(self, m) -> bool:
        return m.is_completed()

    def error(self, m) -> str:
        return ""


def bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 -> [B, V] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()


def torch_apply(logits: torch.Tensor, bitmask: torch.Tensor, shifts: torch.Tensor) -> None:
    """Library-agnostic: unpack to bool, masked_fill_ -inf."""
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def stats_us(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {"n": 0, "mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    s = sorted(ns)
    p = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))] / 1e3
    return {"n": len(s), "mean": statistics.fmean(s) / 1e3, "p50": p(0.5), "p99": p(0.99), "max": s[-1] / 1e3}


def order(round_idx: int, libs: dict[str, Any]) -> list[Any]:
    items = [libs[n] for n in LIBS]
    return items if round_idx % 2 == 0 else items[::-1]


def short(msg: str, n: int = 160) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= n else msg[: n - 1] + "…"


# ----------------------------------------------------------------------------------------------------------
# Parts
# ----------------------------------------------------------------------------------------------------------


def part_compile(libs: dict[str, Any], rounds: int) -> dict[str, dict[str, Any]]:
    """Cold compile (xgrammar's cache cleared first; llguidance builds a new LLMatcher), cached compile
    (xgrammar cache hit; llguidance deep_copy of the kept template), first mask on a fresh request matcher."""
    out: dict[str, dict[str, Any]] = {}
    for name, kind, spec, _ in WORKLOADS:
        rows: dict[str, dict[str, list[float]]] = {n: {"cold": [], "cached": [], "first_mask": []} for n in LIBS}
        errors: dict[str, str] = {}
        for r in range(rounds):
            for lib in order(r, libs):
                if lib.name in errors:
                    continue
                vocab = lib.vocab
                bm = llg_torch.allocate_token_bitmask(1, vocab)
                lib.clear_cache()
                try:
                    t0 = time.perf_counter_ns()
                    compiled = lib.compile(kind, spec)
                    t1 = time.perf_counter_ns()
                except Exception as e:  # noqa: BLE001 - report, not crash
                    errors[lib.name] = short(f"{type(e).__name__}: {e}")
                    continue
                t2 = time.perf_counter_ns()
                compiled2 = lib.compile_cached(kind, spec, compiled)
                t3 = time.perf_counter_ns()
                m = lib.matcher(compiled2)
                t4 = time.perf_counter_ns()
                lib.fill(m, bm, 0)
                t5 = time.perf_counter_ns()
                rows[lib.name]["cold"].append((t1 - t0) / 1e6)
                rows[lib.name]["cached"].append((t3 - t2) / 1e6)
                rows[lib.name]["first_mask"].append((t5 - t4) / 1e3)  # matcher creation + first mask, µs
        out[name] = {n: {k: (statistics.median(v) if v else None) for k, v in rows[n].items()} for n in LIBS}
        for n, e in errors.items():
            out[name][n]["error"] = e
    return out


def walk(lib, compiled, tokens: list[int], stop_ids: list[int], bm: torch.Tensor, rollback_k: int) -> dict[str, Any]:
    """Drive one fresh matcher along `tokens`; time every mask and every advance."""
    m = lib.matcher(compiled)
    mask_ns: list[int] = []
    adv_ns: list[int] = []
    failed_at = None
    for i, t in enumerate(tokens):
        t0 = time.perf_counter_ns()
        lib.fill(m, bm, 0)
        t1 = time.perf_counter_ns()
        allowed = bit(bm, 0, t)
        t2 = time.perf_counter_ns()
        ok = lib.advance(m, t)
        t3 = time.perf_counter_ns()
        mask_ns.append(t1 - t0)
        adv_ns.append(t3 - t2)
        if not (allowed and ok):
            failed_at = (i, allowed, ok, lib.error(m))
            break
    res: dict[str, Any] = {"mask_ns": mask_ns, "adv_ns": adv_ns, "failed_at": failed_at}
    if failed_at is not None:
        return res
    # rollback k tokens and re-advance (speculative decoding's reject path)
    k = min(rollback_k, len(tokens))
    lib.fill(m, bm, 0)
    before = bm.clone()
    t0 = time.perf_counter_ns()
    lib.rollback(m, k)
    t1 = time.perf_counter_ns()
    res["rollback_ns"] = t1 - t0
    res["rollback_ok"] = all(lib.advance(m, t) for t in tokens[len(tokens) - k:])
    lib.fill(m, bm, 0)
    res["rollback_same_mask"] = bool(torch.equal(before, bm))
    # end of document: EOS must be allowed, and ends the matcher
    res["accepting"] = lib.accepting(m)
    res["eos_allowed"] = all(bit(bm, 0, s) for s in stop_ids)  # every stop token, and nothing else
    res["n_allowed_at_end"] = int(unpack(bm, lib.vocab).sum())
    res["eos_ok"] = lib.advance(m, stop_ids[0])
    res["finished"] = lib.finished(m)
    return res


def part_mask(libs: dict[str, Any], hf_tok, stop_ids: list[int], rounds: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    compiled = {n: {} for n in LIBS}
    for name, kind, spec, _ in WORKLOADS:
        for n in LIBS:
            try:
                compiled[n][name] = libs[n].compile(kind, spec)
            except Exception:  # noqa: BLE001 - shown in the compile table
                pass
    all_mask: dict[str, list[int]] = {n: [] for n in LIBS}
    for name, _kind, _spec, text in WORKLOADS:
        tokens = hf_tok.encode(text, add_special_tokens=False)
        acc: dict[str, dict[str, Any]] = {n: {"mask_ns": [], "adv_ns": [], "rollback_ns": []} for n in LIBS}
        for r in range(rounds):
            for lib in order(r, libs):
                if name not in compiled[lib.name]:
                    continue
                bm = llg_torch.allocate_token_bitmask(1, lib.vocab)
                gc.disable()
                try:
                    res = walk(lib, compiled[lib.name][name], tokens, stop_ids, bm, rollback_k=5)
                finally:
                    gc.enable()
                a = acc[lib.name]
                a["mask_ns"] += res["mask_ns"]
                a["adv_ns"] += res["adv_ns"]
                if "rollback_ns" in res:
                    a["rollback_ns"].append(res["rollback_ns"])
                a["last"] = {k: v for k, v in res.items() if not k.endswith("_ns")}
        out[name] = {"n_tokens": len(tokens)}
        for n in LIBS:
            a = acc[n]
            all_mask[n] += a["mask_ns"]
            out[name][n] = {"mask_us": stats_us(a["mask_ns"]), "advance_us": stats_us(a["adv_ns"]),
                            "rollback5_us": stats_us(a["rollback_ns"]), **a.get("last", {})}
    out["_all"] = {n: {"mask_us": stats_us(all_mask[n])} for n in LIBS}
    return out


def part_apply(libs: dict[str, Any], vocab: int, iters: int) -> dict[str, Any]:
    """Cost of masking float32 logits [B, V] with a bitmask: xgrammar's CPU kernel, a plain-torch unpack +
    masked_fill_, and llguidance.torch's torch.compile'd kernel (its first call compiles). Timed with 1 torch
    thread and with the default count: on a loaded 2-core box, OpenMP regions can stall."""
    xl = libs["xgrammar"]
    compiled = xl.compile("json_object", None)
    m = xl.matcher(compiled)
    sparse = xgr.allocate_token_bitmask(1, vocab)
    xl.fill(m, sparse, 0)  # at "{": a handful of tokens allowed
    m.accept_string('{"key": "')
    dense = xgr.allocate_token_bitmask(1, vocab)
    xl.fill(m, dense, 0)  # inside a string: almost everything allowed
    shifts = torch.arange(32, dtype=torch.int32)
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    default_threads = torch.get_num_threads()
    for batch in (1, 8):
        bm = torch.cat([sparse if i % 2 == 0 else dense for i in range(batch)])
        src = torch.randn(batch, vocab, generator=gen)
        ref = src.clone()
        xgr.apply_token_bitmask_inplace(ref, bm)
        fns: dict[str, Callable[[torch.Tensor], None]] = {
            "xgrammar.apply_token_bitmask_inplace (cpu kernel)":
                lambda x, bm=bm: xgr.apply_token_bitmask_inplace(x, bm),
            "torch unpack + masked_fill_": lambda x, bm=bm: torch_apply(x, bm, shifts),
            "llguidance.torch.apply_token_bitmask_inplace (torch.compile)":
                lambda x, bm=bm: llg_torch.apply_token_bitmask_inplace(x, bm),
        }
        res: dict[str, Any] = {}
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            for label, fn in fns.items():
                key = f"{label}, {threads} thread(s)"
                x = src.clone()
                t0 = time.perf_counter_ns()
                try:
                    fn(x)
                except Exception as e:  # noqa: BLE001 - report, not crash
                    res[key] = {"error": short(f"{type(e).__name__}: {e}")}
                    continue
                first_ms = (time.perf_counter_ns() - t0) / 1e6
                same = bool(torch.equal(x, ref))
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter_ns()
                    fn(x)  # idempotent: re-applying the same mask costs the same work
                    times.append(time.perf_counter_ns() - t0)
                res[key] = {"first_call_ms": first_ms, "same_as_xgrammar": same, **stats_us(times)}
        torch.set_num_threads(default_threads)
        out[f"[{batch}, {vocab}]"] = res
    return out


def part_batch(libs: dict[str, Any], hf_tok, steps: int, batch: int = 8) -> dict[str, Any]:
    """8 requests at different offsets of the same JSON document: serial per-row fill vs the libraries'
    parallel batch calls (LLExecutor / BatchGrammarMatcher, 2 threads)."""
    name, kind, spec, text = WORKLOADS[1]  # nested_arrays_enum
    tokens = hf_tok.encode(text, add_special_tokens=False)
    executor = llguidance.LLExecutor(num_threads=2)
    batcher = xgr.BatchGrammarMatcher(max_threads=2)
    out: dict[str, Any] = {"workload": name, "batch": batch}
    times: dict[str, list[int]] = {}
    for r in range(2):
        for lib in order(r, libs):
            compiled = lib.compile(kind, spec)
            for mode in ("serial", "parallel"):
                ms = [lib.matcher(compiled) for _ in range(batch)]
                pos = [0] * batch
                for i, m in enumerate(ms):  # spread the requests along the document
                    for t in tokens[: (i * len(tokens)) // batch]:
                        lib.advance(m, t)
                    pos[i] = (i * len(tokens)) // batch
                bm = llg_torch.allocate_token_bitmask(batch, lib.vocab)
                key = f"{lib.name} {mode}"
                gc.disable()
                for _ in range(steps):
                    t0 = time.perf_counter_ns()
                    if mode == "serial":
                        for i, m in enumerate(ms):
                            lib.fill(m, bm, i)
                    elif lib.name == "llguidance":
                        llg_torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], bm)
                    else:
                        batcher.batch_fill_next_token_bitmask(ms, bm)
                    times.setdefault(key, []).append(time.perf_counter_ns() - t0)
                    for i, m in enumerate(ms):
                        assert bit(bm, i, tokens[pos[i]]), (key, i, pos[i])
                        lib.advance(m, tokens[pos[i]])
                        pos[i] += 1
                        if pos[i] >= len(tokens):
                            m.reset()
                            pos[i] = 0
                gc.enable()
    for key, ns in times.items():
        out[key] = stats_us(ns)
    return out


COVERAGE: list[tuple[str, dict[str, Any], Any, Any]] = [
    ("$ref/$defs", {"$defs": {"P": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/P"}},
                    "required": ["a"]}, {"a": 1}, {"a": "x"}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x", True),
    ("oneOf (disjoint)", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "s"),
    ("oneOf (overlapping: 1 matches both)", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1.5, 1),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1, "b": "x"}, {"a": 1}),
    ("enum", {"enum": ["red", "green", 3]}, "green", "blue"),
    ("const", {"const": "fixed"}, "fixed", "other"),
    ("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "abc-12", "abc-1x"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcde"),
    ("format: date-time", {"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z", "yesterday"),
    ("format: email", {"type": "string", "format": "email"}, "a@b.co", "not-an-email"),
    ("format: uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "1234"),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [1, 2], [1]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
     [1, "a"], ["a", 1]),
    ("additionalProperties: false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    ("additionalProperties: true", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": True}, {"a": 1, "b": "x"}, {"a": "x"}),
    ("additionalProperties: schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "additionalProperties": {"type": "string"}}, {"a": 1, "b": "x"},
     {"a": 1, "b": 2}),
    ("additionalProperties absent (spec: allowed)", {"type": "object", "properties": {"a": {"type": "integer"}}},
     {"a": 1, "b": 2}, {"a": "x"}),
    ("properties out of declared order", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                           "b": {"type": "integer"}}},
     {"b": 2, "a": 1}, {"b": "x"}),
    ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 10}, 10, 11),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ('type list ["string","null"]', {"type": ["string", "null"]}, None, 1),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}}, "$ref": "#/$defs/node"},
     {"v": 1, "children": [{"v": 2, "children": []}]}, {"v": 1, "children": [{"children": []}]}),
    ("minProperties", {"type": "object", "minProperties": 2}, {"a": 1, "b": 2}, {"a": 1}),
    ("patternProperties", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"n_a": "x"}),
    ("if/then/else", {"type": "object", "properties": {"k": {"type": "string"}, "v": {}},
                      "if": {"properties": {"k": {"const": "i"}}}, "then": {"properties": {"v": {"type": "integer"}}},
                      "else": {"properties": {"v": {"type": "string"}}}}, {"k": "i", "v": 1}, {"k": "i", "v": "x"}),
    ("not", {"not": {"type": "string"}}, 1, "x"),
]


COVERAGE_VARIANTS = ("llguidance", "xgrammar", "xgrammar strict_mode=False")


def accepts(lib, compiled, tokens: list[int]) -> bool:
    m = lib.matcher(compiled)
    if lib.name == "llguidance":
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting() and not m.is_error()
    return all(m.accept_token(t) for t in tokens) and m.is_completed()


def part_coverage(libs: dict[str, Any], hf_tok) -> list[dict[str, Any]]:
    rows = []
    checker = jsonschema.FormatChecker()
    for feature, schema, valid, invalid in COVERAGE:
        vt = hf_tok.encode(json.dumps(valid), add_special_tokens=False)
        it = hf_tok.encode(json.dumps(invalid), add_special_tokens=False)
        row: dict[str, Any] = {"feature": feature, "schema": schema, "valid": valid, "invalid": invalid,
                               "jsonschema_valid_ok": jsonschema.Draft202012Validator(
                                   schema, format_checker=checker).is_valid(valid),
                               "jsonschema_invalid_refused": not jsonschema.Draft202012Validator(
                                   schema, format_checker=checker).is_valid(invalid)}
        for n in COVERAGE_VARIANTS:
            lib = libs[n.split()[0]]
            warnings: list[str] = []
            try:
                if n == "llguidance":
                    g = lib.grammar("json_schema", schema)
                    is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(g, lib.tok)
                    if is_err:
                        raise ValueError(msgs[0] if msgs else "invalid grammar")
                    warnings = msgs
                    compiled = lib.compile("json_schema", schema)
                else:
                    compiled = lib.compiler.compile_json_schema(json.dumps(schema), strict_mode=n == "xgrammar")
            except Exception as e:  # noqa: BLE001 - the error is the result
                row[n] = {"status": "REJECTED", "detail": short(f"{type(e).__name__}: {e}", 200)}
                continue
            ok_valid = accepts(lib, compiled, vt)
            refused_invalid = not accepts(lib, compiled, it)
            if ok_valid and refused_invalid:
                status = "enforced"
            elif ok_valid:
                status = "compiles, NOT enforced"
            elif refused_invalid:
                status = "valid instance refused"
            else:
                status = "broken"
            row[n] = {"status": status, "valid_accepted": ok_valid, "invalid_refused": refused_invalid,
                      "detail": short("; ".join(warnings), 200)}
        rows.append(row)
    return rows


def part_random_walk(libs: dict[str, Any], hf_tok, vocab: int, stop_ids: list[int],
                     max_steps: int = 200) -> list[dict[str, Any]]:
    """Greedy over random logits under the mask (compact whitespace, or flexible whitespace lets argmax
    emit blanks forever); after step 40 a growing bias towards closing tokens (", }, ], EOS) so most walks end.
    Same seed for both libraries; their texts still differ (different masks, e.g. special tokens)."""
    decoded = libs["xgrammar"].info.decoded_vocab
    closers = torch.zeros(vocab, dtype=torch.bool)
    for i, b in enumerate(decoded[:vocab]):
        s = b.strip()
        if s and all(c in b'"}],' for c in s):
            closers[i] = True
    shifts = torch.arange(32, dtype=torch.int32)
    out = []
    for name, kind, spec, _ in WORKLOADS:
        if kind not in ("json_schema", "json_object"):
            continue
        schema = spec if kind == "json_schema" else {"type": "object"}
        row: dict[str, Any] = {"workload": name}
        for lib in (libs[n] for n in LIBS):
            gen = torch.Generator().manual_seed(1234)
            compiled = lib.compile(kind, spec, compact=True)
            m = lib.matcher(compiled)
            bm = llg_torch.allocate_token_bitmask(1, vocab)
            toks: list[int] = []
            ended = False
            for step in range(max_steps):
                lib.fill(m, bm, 0)
                logits = torch.randn(1, vocab, generator=gen)
                if step >= 40:
                    logits[0, closers] += 2.0 + 0.1 * (step - 40)
                logits[0, stop_ids] += 10.0
                torch_apply(logits, bm, shifts)
                t = int(logits.argmax())
                if t in stop_ids:
                    ended = lib.advance(m, t)
                    break
                if not lib.advance(m, t):
                    toks.append(t)
                    row[lib.name] = {"ok": False, "detail": f"token {t} refused after mask: {lib.error(m)}"}
                    break
                toks.append(t)
            text = hf_tok.decode(toks, skip_special_tokens=False)
            if lib.name in row:
                continue
            res: dict[str, Any] = {"steps": len(toks), "ended_with_eos": ended, "text": text}
            if not ended:
                res.update(ok=None, detail=f"not finished in {max_steps} steps")
            else:
                try:
                    jsonschema.validate(json.loads(text), schema)
                    res.update(ok=True, detail="parses + validates")
                except Exception as e:  # noqa: BLE001 - the failure is the result
                    res.update(ok=False, detail=short(f"{type(e).__name__}: {e}"))
            row[lib.name] = res
        out.append(row)
    return out


def part_gil(libs: dict[str, Any], hf_tok) -> dict[str, Any]:
    """Does a long library call release the GIL? Run it once in a thread while the main thread spins in Python
    noting the longest pause between its iterations: a pause as long as the call means the GIL was held
    throughout; short pauses (scheduling only) mean it was released. This works on a loaded machine, where
    two-thread speedups do not. References: sum(range(n)) (a C loop that holds the GIL) and hashlib.sha256
    (releases it)."""

    def gap_test(fn: Callable[[], Any]) -> dict[str, Any]:
        done = threading.Event()
        dur = [0.0]

        def bg():
            t0 = time.perf_counter()
            fn()
            dur[0] = time.perf_counter() - t0
            done.set()

        th = threading.Thread(target=bg)
        last = time.perf_counter()
        max_gap = 0.0
        iters = 0
        th.start()
        while not done.is_set():
            now = time.perf_counter()
            max_gap = max(max_gap, now - last)
            last = now
            iters += 1
        th.join()
        verdict = "held" if max_gap > 0.5 * dur[0] else "released"
        if dur[0] < 0.01 or iters == 0:
            verdict = "too short to tell"
        return {"call_ms": dur[0] * 1e3, "max_main_pause_ms": max_gap * 1e3, "main_iters": iters, "gil": verdict}

    blob = b"x" * (64 << 20)
    out: dict[str, Any] = {"sum(range(3e7)) (reference: holds)": gap_test(lambda: sum(range(30_000_000))),
                           "hashlib.sha256 of 64 MiB (reference: releases)": gap_test(
                               lambda: hashlib.sha256(blob).digest())}
    big = {"type": "object", "properties": {"k": {"enum": [f"value_{i}_{i * 7919 % 10007}" for i in range(20000)]}},
           "required": ["k"]}
    llg_lib, xgr_lib = libs["llguidance"], libs["xgrammar"]
    g = llguidance.LLMatcher.grammar_from_json_schema(big)
    out["llguidance: grammar_from_json_schema (20k-value enum)"] = gap_test(
        lambda: llguidance.LLMatcher.grammar_from_json_schema(big))
    out["llguidance: LLMatcher(tok, grammar) (20k-value enum)"] = gap_test(lambda: llguidance.LLMatcher(llg_lib.tok, g))
    nocache = xgr.GrammarCompiler(xgr_lib.info, max_threads=1, cache_enabled=False)
    out["xgrammar: compile_json_schema (20k-value enum)"] = gap_test(
        lambda: nocache.compile_json_schema(json.dumps(big)))
    n = 512
    prefix = hf_tok.encode('{"key": "abc', add_special_tokens=False)
    ms = []
    for _ in range(n):
        m = llg_lib.compile("json_object", None)
        m.consume_tokens(prefix)
        ms.append(m)
    bm = llg_torch.allocate_token_bitmask(n, llg_lib.vocab)
    executor = llguidance.LLExecutor(num_threads=1)
    out[f"llguidance: fill_next_token_bitmask_par, {n} rows, 1 thread"] = gap_test(
        lambda: llg_torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], bm))
    compiled = xgr_lib.compile("json_object", None)
    xms = []
    for _ in range(n):
        m = xgr.GrammarMatcher(compiled)
        for t in prefix:
            m.accept_token(t)
        xms.append(m)
    batcher = xgr.BatchGrammarMatcher(max_threads=1)
    out[f"xgrammar: batch_fill_next_token_bitmask, {n} rows, 1 thread"] = gap_test(
        lambda: batcher.batch_fill_next_token_bitmask(xms, bm))
    return out


def part_mask_diff(libs: dict[str, Any], hf_tok) -> dict[str, Any]:
    """Walk both libraries in lockstep along each valid document and compare their masks token by token."""
    out: dict[str, Any] = {}
    vocab = len(hf_tok)
    only: dict[str, dict[int, int]] = {n: {} for n in LIBS}
    for name, kind, spec, text in WORKLOADS:
        tokens = hf_tok.encode(text, add_special_tokens=False)
        try:
            ms = {n: libs[n].matcher(libs[n].compile(kind, spec)) for n in LIBS}
        except Exception:  # noqa: BLE001 - shown in the compile table
            continue
        bms = {n: llg_torch.allocate_token_bitmask(1, vocab) for n in LIBS}
        steps_differ = 0
        max_only = {n: 0 for n in LIBS}
        for t in tokens + [None]:
            for n in LIBS:
                libs[n].fill(ms[n], bms[n], 0)
            a, b = unpack(bms["llguidance"], vocab)[0], unpack(bms["xgrammar"], vocab)[0]
            if not torch.equal(a, b):
                steps_differ += 1
                for n, d in (("llguidance", a & ~b), ("xgrammar", b & ~a)):
                    ids = torch.nonzero(d).view(-1).tolist()
                    max_only[n] = max(max_only[n], len(ids))
                    if len(ids) < 1000:  # bigger: a different structural decision (see max columns), not a detail
                        for i in ids:
                            only[n][i] = only[n].get(i, 0) + 1
            if t is None:
                break
            for n in LIBS:
                libs[n].advance(ms[n], t)
        out[name] = {"steps": len(tokens) + 1, "steps_differ": steps_differ,
                     **{f"max_only_{n}": max_only[n] for n in LIBS}}
    for n in LIBS:
        ids = sorted(only[n], key=lambda i: -only[n][i])
        out[f"only_{n}"] = {"n_tokens": len(ids), "examples": [hf_tok.convert_ids_to_tokens(i) for i in ids[:12]]}
    return out


def part_specials(libs: dict[str, Any], hf_tok) -> dict[str, Any]:
    """Inside a JSON string, which special/control tokens does each library allow? (Should be none.)"""
    vocab = len(hf_tok)
    special = sorted(i for i, a in hf_tok.added_tokens_decoder.items() if a.special)
    pads = [i for t, i in hf_tok.get_vocab().items() if t.startswith("[PAD")]
    quote = hf_tok.encode('"', add_special_tokens=False)
    out: dict[str, Any] = {"n_special": len(special), "n_pad": len(pads)}
    for n in LIBS:
        lib = libs[n]
        m = lib.matcher(lib.compile("json_schema", {"type": "string"}))
        for t in quote:
            lib.advance(m, t)
        bm = llg_torch.allocate_token_bitmask(1, vocab)
        lib.fill(m, bm, 0)
        allowed = unpack(bm, vocab)[0]
        sp = [i for i in special if allowed[i]]
        out[n] = {"special_allowed": len(sp), "special_examples": hf_tok.convert_ids_to_tokens(sp[:4]),
                  "pad_allowed": sum(1 for i in pads if allowed[i]), "n_allowed": int(allowed.sum())}
    return out


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x != x:
            return "—"
        return f"{x:.{nd}f}"
    return str(x)


def ratio(a: Any, b: Any) -> str:
    if not a or not b or a != a or b != b:
        return "—"
    return f"{a / b:.2f}"


def render(results: dict[str, Any]) -> str:
    L: list[str] = []
    L.append("# llguidance vs xgrammar on this CPU\n")
    cmd = " ".join(["benchmarks/grammar_backends.py", *results["argv"]])
    L.append(f"Command: `.venv/bin/python {cmd}`  ")
    L.append(f"Versions: llguidance {results['versions']['llguidance']}, xgrammar {results['versions']['xgrammar']}, "
             f"torch {results['versions']['torch']}; {results['machine']}. Ratios are xgrammar / llguidance "
             "(< 1: xgrammar faster), measured alternately in one process.\n")
    for tk, tr in results["tokenizers"].items():
        L.append(f"## Tokenizer {tk} (vocab {tr['vocab']}, stop ids {tr['stop_ids']})\n")
        L.append(f"Tokenizer-info build: llguidance `hf.from_tokenizer` {tr['tokinfo_s']['llguidance']:.2f} s, "
                 f"xgrammar `TokenizerInfo.from_huggingface` {tr['tokinfo_s']['xgrammar']:.2f} s "
                 f"(+ `GrammarCompiler` {tr['compiler_init_s']:.3f} s).\n")
        L.append("### Compile (median of rounds)\n")
        L.append("cold ms: llguidance = new `LLMatcher` (no cache), xgrammar = `compile_*` after `clear_cache()`. "
                 "cached ms: llguidance = `deep_copy()` of a kept template, xgrammar = cache hit. "
                 "first mask µs = request matcher creation + first bitmask (llguidance builds its lexer lazily, "
                 "so its cold cost shows up here and in the first steps).\n")
        L.append("| grammar | llg cold ms | llg cached ms | llg 1st mask µs | xgr cold ms | xgr cached ms "
                 "| xgr 1st mask µs | cold+1st ratio |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in tr["compile"].items():
            a, b = r["llguidance"], r["xgrammar"]
            cells = []
            for x in (a, b):
                if "error" in x:
                    cells += [f"ERROR: {x['error']}", "", ""]
                else:
                    cells += [fmt(x["cold"], 2), fmt(x["cached"], 3), fmt(x["first_mask"], 0)]
            tot = lambda x: (x["cold"] * 1e3 + x["first_mask"]) if "error" not in x and x["cold"] is not None else None
            L.append(f"| {name} | " + " | ".join(cells) + f" | {ratio(tot(b), tot(a))} |")
        L.append("")
        L.append("### Per-token bitmask along a valid document (fresh matcher per walk, all steps of all rounds)\n")
        L.append("| grammar | tokens | llg mean | llg p50 | llg p99 | xgr mean | xgr p50 | xgr p99 | mean ratio "
                 "| llg adv | xgr adv | llg rb5 | xgr rb5 | checks |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, r in tr["mask"].items():
            if name == "_all":
                continue
            a, b = r["llguidance"], r["xgrammar"]
            checks = []
            for n, x in (("llg", a), ("xgr", b)):
                if x.get("failed_at"):
                    checks.append(f"{n} FAIL at {x['failed_at']}")
                elif "eos_ok" in x:
                    good = x["eos_allowed"] and x["eos_ok"] and x["finished"] and x["rollback_ok"] \
                        and x["rollback_same_mask"]
                    checks.append(f"{n} ok" if good else f"{n} eos/rollback: {x}")
            L.append(f"| {name} | {r['n_tokens']} | {fmt(a['mask_us']['mean'])} | {fmt(a['mask_us']['p50'])} | "
                     f"{fmt(a['mask_us']['p99'])} | {fmt(b['mask_us']['mean'])} | {fmt(b['mask_us']['p50'])} | "
                     f"{fmt(b['mask_us']['p99'])} | {ratio(b['mask_us']['mean'], a['mask_us']['mean'])} | "
                     f"{fmt(a['advance_us']['mean'])} | {fmt(b['advance_us']['mean'])} | "
                     f"{fmt(a['rollback5_us']['mean'])} | {fmt(b['rollback5_us']['mean'])} | {', '.join(checks)} |")
        a, b = tr["mask"]["_all"]["llguidance"]["mask_us"], tr["mask"]["_all"]["xgrammar"]["mask_us"]
        L.append(f"| **all** | {a['n']} | {fmt(a['mean'])} | {fmt(a['p50'])} | {fmt(a['p99'])} | {fmt(b['mean'])} | "
                 f"{fmt(b['p50'])} | {fmt(b['p99'])} | {ratio(b['mean'], a['mean'])} | | | | | |")
        L.append("\nAll figures µs. adv = advance by one token; rb5 = rollback of 5 tokens; checks = every token "
                 "allowed by the mask and accepted, EOS allowed at the end and accepted, matcher finished, "
                 "rollback + re-advance gives the same mask.\n")
        L.append("### Applying a bitmask to float32 logits (µs)\n")
        L.append("| shape | method | mean | p50 | p99 | first call ms | same result |")
        L.append("|---|---|---:|---:|---:|---:|---|")
        for shape, rr in tr["apply"].items():
            for label, x in rr.items():
                if "error" in x:
                    L.append(f"| {shape} | {label} | ERROR: {x['error']} | | | | |")
                else:
                    L.append(f"| {shape} | {label} | {fmt(x['mean'])} | {fmt(x['p50'])} | {fmt(x['p99'])} | "
                             f"{fmt(x['first_call_ms'], 1)} | {x['same_as_xgrammar']} |")
        L.append("")
        bt = tr["batch"]
        L.append(f"### Batch of {bt['batch']} requests ({bt['workload']}), bitmask for all rows (µs per batch)\n")
        L.append("| library | mode | mean | p50 | p99 |")
        L.append("|---|---|---:|---:|---:|")
        for key, x in bt.items():
            if isinstance(x, dict):
                lib, mode = key.split()
                api = {"llguidance parallel": "fill_next_token_bitmask_par (LLExecutor, 2 threads)",
                       "xgrammar parallel": "BatchGrammarMatcher.batch_fill_next_token_bitmask (2 threads)"}
                L.append(f"| {lib} | {api.get(key, 'per-row fill, serial')} | {fmt(x['mean'])} | {fmt(x['p50'])} "
                         f"| {fmt(x['p99'])} |")
        L.append("")
        sp = tr["specials"]
        L.append(f"### Special tokens inside a JSON string ({sp['n_special']} special added tokens, "
                 f"{sp['n_pad']} `[PAD…]` filler tokens in this vocab)\n")
        L.append("| library | tokens allowed | special tokens allowed | `[PAD…]` allowed |")
        L.append("|---|---:|---|---:|")
        for n in LIBS:
            x = sp[n]
            ex = f" e.g. {', '.join(x['special_examples'])}" if x["special_allowed"] else ""
            L.append(f"| {n} | {x['n_allowed']} | {x['special_allowed']}{ex} | {x['pad_allowed']} |")
        L.append("")
        md = tr["mask_diff"]
        L.append("### Mask agreement along the valid documents (both libraries in lockstep)\n")
        L.append("| grammar | steps | steps where masks differ | max tokens only llg allows | "
                 "max tokens only xgr allows |")
        L.append("|---|---:|---:|---:|---:|")
        for name, x in md.items():
            if not name.startswith("only_"):
                L.append(f"| {name} | {x['steps']} | {x['steps_differ']} | {x['max_only_llguidance']} | "
                         f"{x['max_only_xgrammar']} |")
        for n in LIBS:
            x = md[f"only_{n}"]
            ex = ", ".join(f"`{e}`" for e in x["examples"]).replace("|", "\\|")
            L.append(f"\nTokens only {n} allowed (steps differing by < 1000 tokens): {x['n_tokens']}; "
                     f"most frequent: {ex}")
        L.append("")
    cov_tok = results["coverage_tokenizer"]
    L.append(f"## JSON Schema coverage (tokenizer {cov_tok})\n")
    L.append("enforced = a valid instance is accepted and a violating one refused; NOT enforced = compiles but "
             "the violating instance passes; REJECTED = compile error.\n")
    L.append("| feature | valid / violating | llguidance | xgrammar (default strict_mode=True) | "
             "xgrammar strict_mode=False |")
    L.append("|---|---|---|---|---|")
    for row in results["coverage"]:
        cells = []
        for n in COVERAGE_VARIANTS:
            x = row[n]
            d = f" ({x['detail']})" if x.get("detail") else ""
            cells.append(f"{x['status']}{d}".replace("|", "\\|"))
        ex = f"`{json.dumps(row['valid'])}` / `{json.dumps(row['invalid'])}`".replace("|", "\\|")
        L.append(f"| {row['feature']} | {ex} | " + " | ".join(cells) + " |")
    L.append("")
    for tk, tr in results["tokenizers"].items():
        L.append(f"## Masked random-logits walk, tokenizer {tk}\n")
        L.append("| schema | llguidance | xgrammar |")
        L.append("|---|---|---|")
        for row in tr["random_walk"]:
            cells = []
            for n in LIBS:
                x = row[n]
                cells.append(f"{x['detail']} ({x.get('steps', '?')} tokens)")
            L.append(f"| {row['workload']} | {cells[0]} | {cells[1]} |")
        L.append("")
        for row in tr["random_walk"]:
            for n in LIBS:
                if row[n].get("text"):
                    L.append(f"- {row['workload']} / {n}: `{short(row[n]['text'], 220)}`")
        L.append("")
    g = results["gil"]
    L.append(f"## GIL (tokenizer {results['coverage_tokenizer']})\n")
    L.append("One long call in a thread while the main thread spins in Python: if the main thread's longest pause "
             "is about the call's duration, the call held the GIL.\n")
    L.append("| call | call ms | main thread's longest pause ms | main-thread iterations | GIL |")
    L.append("|---|---:|---:|---:|---|")
    for k, v in g.items():
        L.append(f"| {k} | {v['call_ms']:.1f} | {v['max_main_pause_ms']:.1f} | {v['main_iters']} | {v['gil']} |")
    L.append("")
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizers", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per measurement")
    ap.add_argument("--apply-iters", type=int, default=200)
    ap.add_argument("--batch-steps", type=int, default=60)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "grammar_backends"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "argv": sys.argv[1:],
        "versions": {"llguidance": llguidance.__version__, "xgrammar": _xgr_version(), "torch": torch.__version__},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, python {platform.python_version()}",
        "tokenizers": {},
    }
    first = None
    for tk in args.tokenizers.split(","):
        print(f"== {tk}: loading tokenizer", flush=True)
        hf_tok = load_tokenizer(tk)
        vocab = len(hf_tok)
        stop_ids = sorted({hf_tok.eos_token_id} | {hf_tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>",)
                                                   if t in hf_tok.get_vocab()})
        stop_ids.remove(hf_tok.eos_token_id)
        stop_ids.insert(0, hf_tok.eos_token_id)
        tr: dict[str, Any] = {"vocab": vocab, "stop_ids": stop_ids, "tokinfo_s": {}}
        libs: dict[str, Any] = {}
        for n, cls in (("llguidance", LLG), ("xgrammar", XGR)):
            t0 = time.perf_counter()
            libs[n] = cls(hf_tok, vocab, stop_ids)
            tr["tokinfo_s"][n] = time.perf_counter() - t0
        t0 = time.perf_counter()
        xgr.GrammarCompiler(libs["xgrammar"].info, max_threads=2)
        tr["compiler_init_s"] = time.perf_counter() - t0
        for lib in libs.values():  # one-time warm-up of each library's code paths
            m = lib.matcher(lib.compile("regex", "[ab]"))
            lib.fill(m, llg_torch.allocate_token_bitmask(1, vocab), 0)
        print(f"== {tk}: compile", flush=True)
        tr["compile"] = part_compile(libs, args.rounds)
        print(f"== {tk}: per-token masks", flush=True)
        tr["mask"] = part_mask(libs, hf_tok, stop_ids, args.rounds)
        print(f"== {tk}: apply", flush=True)
        tr["apply"] = part_apply(libs, vocab, args.apply_iters)
        print(f"== {tk}: batch", flush=True)
        tr["batch"] = part_batch(libs, hf_tok, args.batch_steps)
        print(f"== {tk}: random walks", flush=True)
        tr["random_walk"] = part_random_walk(libs, hf_tok, vocab, stop_ids)
        tr["specials"] = part_specials(libs, hf_tok)
        tr["mask_diff"] = part_mask_diff(libs, hf_tok)
        results["tokenizers"][tk] = tr
        if first is None:
            first = (tk, libs, hf_tok)
    tk, libs, hf_tok = first
    print(f"== coverage ({tk})", flush=True)
    results["coverage_tokenizer"] = tk
    results["coverage"] = part_coverage(libs, hf_tok)
    print(f"== GIL ({tk})", flush=True)
    results["gil"] = part_gil(libs, hf_tok)
    results["seconds"] = time.perf_counter() - t_start
    md = render(results) + f"\nTotal run time {results['seconds']:.0f} s.\n"
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


def _xgr_version() -> str:
    from importlib.metadata import version

    return version("xgrammar")


if __name__ == "__main__":
    main()
