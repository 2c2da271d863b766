#!/usr/bin/env python3
"""Structured outputs, measured: what a constraint costs per token, what it costs its neighbours, and what it buys.

    .venv/bin/python benchmarks/structured_outputs.py --parts masks        # compile, mask and apply costs
    .venv/bin/python benchmarks/structured_outputs.py --parts neighbours   # free requests beside JSON-schema ones
    .venv/bin/python benchmarks/structured_outputs.py --parts quality      # qwen2.5-coder-1.5b: valid JSON with/without
    .venv/bin/python benchmarks/structured_outputs.py --parts masks --tokenizers smollm2-135m --schemas plain  # smoke

Why: a constrained request computes a token mask each step on the same cores as the model; these parts say how
much that is (masks), whether the unconstrained requests in the same batch pay for it (neighbours) and what the
constraint gives in return (quality). docs/performance.md, "Structured outputs", has the figures.

masks: offline, per tokenizer (SmolLM2's 49k and Qwen's 152k vocabularies by default): schema compile time cold and
cached, the mask of one row and of a batch (llguidance, through the engine's `StructuredOutputManager`), and applying
the masks to the logits (the sampler's `_apply_token_bitmask`).
neighbours: one `llmserve serve` (default flags). At c = 8 and 32, a closed loop of chat streams for a fixed time:
all free, or half free and half constrained by a JSON schema (an array of >= 64 short strings, so both kinds run
their whole 128 tokens and the batch keeps its shape). Reported: the free streams' output tok/s per stream in the
mixed run over the all-free run (target >= 0.95), in ABBA rounds.
quality: `--quality-model` (default qwen2.5-coder-1.5b) as `llmserve serve` runs it by default, on MT-Bench questions
asked for an answer as JSON of a given schema: the share of outputs that are valid JSON and that follow the schema,
with the constraint (`response_format` json_schema) and without it (the schema in the prompt only).
Writes <out-dir>/<part>.{md,json} (default out dir: benchmarks/results/structured-outputs/<host>/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_vs_peers import host_tag, machine_facts  # noqa: E402
from gateway import Proc  # noqa: E402

from llmserve.bench.client import BenchClient, ClientConfig  # noqa: E402
from llmserve.bench.report import render_table  # noqa: E402
from llmserve.bench.tokens import approximate_counter  # noqa: E402
from llmserve.bench.workload import WorkloadConfig, find_mtbench_questions, make_workload  # noqa: E402

MODEL = "smollm2-135m"
# >= 64 strings: longer than the 128 tokens a request may write, so both kinds run to their end and a mixed batch
# keeps the all-free batch's shape. "bounded": the same with strings of at most 24 characters, the costliest
# masks measured (llguidance's token-trie slices then cover less of a string).
NOTES_SCHEMAS = {
    "plain": {"type": "object", "properties": {"notes": {"type": "array", "minItems": 64, "items": {"type": "string"}}},
              "required": ["notes"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"notes": {"type": "array", "minItems": 64,
                                                           "items": {"type": "string", "maxLength": 24}}},
                "required": ["notes"], "additionalProperties": False},
}
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 400},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "topics": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 4}},
    "required": ["answer", "confidence", "topics"], "additionalProperties": False}


# --- neighbours ----------------------------------------------------------------------------------


async def _stream_loop(cfg: ClientConfig, workload, concurrency: int, label: str, start: float, end: float,
                       counts: dict[str, int]) -> None:
    """`concurrency` closed-loop streams until `end`; output tokens arriving in [start, end] go to counts[label]."""

    async def worker(client: BenchClient, k: int) -> None:
        i = 0
        while time.perf_counter() < end:
            sent = time.perf_counter()
            rec = await client.send(workload.request(f"{label}-{k}", i))
            i += 1
            if not rec.ok:
                raise RuntimeError(f"{label} request failed: {rec.error_kind} {rec.error}")
            counts[label] += sum(n for t, n in zip(rec.chunk_times_s, rec.chunk_tokens, strict=True)
                                 if start <= sent + t <= end)
            counts[f"{label}_{rec.finish_reason}"] = counts.get(f"{label}_{rec.finish_reason}", 0) + 1

    async with BenchClient(cfg, approximate_counter(), connections=concurrency + 2) as client:
        await asyncio.gather(*(worker(client, k) for k in range(concurrency)))


async def _neighbours_run(url: str, schema: dict[str, Any], concurrency: int, mixed: bool, seconds: float,
                          warmup: float) -> dict[str, Any]:
    workload = make_workload(WorkloadConfig(name="random", input_len=64, output_len=128, seed=7),
                             approximate_counter())
    free = ClientConfig(base_url=url, model=MODEL, keepalive=True)
    constrained = ClientConfig(base_url=url, model=MODEL, keepalive=True, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "notes", "schema": schema}}})
    now = time.perf_counter()
    start, end = now + warmup, now + warmup + seconds
    counts = {"free": 0, "json": 0}
    n_free = concurrency // 2 if mixed else concurrency
    loops = [_stream_loop(free, workload, n_free, "free", start, end, counts)]
    if mixed:
        loops.append(_stream_loop(constrained, workload, concurrency - n_free, "json", start, end, counts))
    await asyncio.gather(*loops)
    return {"free_tok_s_per_stream": counts["free"] / seconds / n_free,
            "json_tok_s_per_stream": counts["json"] / seconds / max(concurrency - n_free, 1) if mixed else 0.0,
            "finishes": {k: v for k, v in counts.items() if "_" in k}}


def part_neighbours(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    server = Proc("structured_server", [sys.executable, "-m", "llmserve.cli", "serve", "--model", MODEL, "--port",
                                        str(args.port), "--no-access-log"], args.port, args.out_dir)
    url = f"http://127.0.0.1:{args.port}"
    record: dict[str, Any] = {}
    try:
        for schema_name in args.schemas:
            schema = NOTES_SCHEMAS[schema_name]
            for c in args.levels:
                asyncio.run(_neighbours_run(url, schema, c, True, 5, 0))  # warm-up: both kinds, the schema compiled
                runs: dict[str, list[dict[str, Any]]] = {"all-free": [], "mixed": []}
                for round_ in range(args.rounds):
                    order = ["all-free", "mixed"] if round_ % 2 == 0 else ["mixed", "all-free"]
                    for name in order:
                        print(f"[structured] {schema_name} c={c} {name} round {round_ + 1}", flush=True)
                        runs[name].append(asyncio.run(_neighbours_run(url, schema, c, name == "mixed",
                                                                      args.seconds, 3)))
                record[f"{schema_name} {c}"] = runs
    finally:
        server.stop()
    rows = []
    for key, runs in record.items():
        ratios = [m["free_tok_s_per_stream"] / a["free_tok_s_per_stream"]
                  for a, m in zip(runs["all-free"], runs["mixed"], strict=True)]
        schema_name, c = key.split()
        rows.append([schema_name, c, f"{statistics.median(r['free_tok_s_per_stream'] for r in runs['all-free']):.2f}",
                     f"{statistics.median(r['free_tok_s_per_stream'] for r in runs['mixed']):.2f}",
                     f"{statistics.median(r['json_tok_s_per_stream'] for r in runs['mixed']):.2f}",
                     f"{statistics.median(ratios):.3f}", " / ".join(f"{r:.3f}" for r in ratios)])
    body = (f"One server (default flags), chat streams of 64 prompt tokens and 128 output tokens in closed loops for "
            f"{args.seconds:.0f} s a run; mixed = half the streams constrained by a JSON schema of >= 64 strings "
            f"(plain, or of at most 24 characters each: bounded). ABBA rounds: {args.rounds}.\n\n"
            + render_table(["schema", "c", "free tok/s per stream, all free", "free, mixed", "JSON, mixed",
                            "mixed / all free (median)", "per round"], rows, markdown=True))
    return body, record


# --- masks ---------------------------------------------------------------------------------------


def _time_us(fn, repeats: int) -> float:
    """Median microseconds of `fn()`."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _masked_copy(apply, logits, bitmask) -> None:
    import torch

    apply(logits.clone(), torch.arange(len(logits)), bitmask)


def _mask_costs(manager, spec, ids: list[int], batch: int, vocab: int, apply) -> tuple[float, float]:
    """Median us of one step's masks for `batch` matchers (a new state each time: llguidance caches a state's
    mask), and of applying them to float32 logits."""
    import numpy as np
    import torch

    matchers = [manager.new_matcher(spec) for _ in range(batch)]
    for m in matchers:  # a third of the way through a document: a typical state
        assert m.consume_tokens(ids[: len(ids) // 3])
    rows = [(str(i), m, []) for i, m in enumerate(matchers)]
    masks = []
    for token in ids[len(ids) // 3: len(ids) // 3 + 20]:
        masks.append(_time_us(partial(manager.bitmasks, rows), 1))
        for m in matchers:
            assert m.consume_token(token)
    bitmask = torch.from_numpy(np.concatenate(list(manager.bitmasks(rows).values())))
    logits = torch.randn(batch, vocab)
    apply_us = _time_us(partial(_masked_copy, apply, logits, bitmask), 20) - _time_us(logits.clone, 20)
    return statistics.median(masks), max(apply_us, 0.0)


def part_masks(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    import torch

    from llmserve.layers.sampler import _apply_token_bitmask
    from llmserve.loader import load_tokenizer
    from llmserve.sampling_params import StructuredOutputsParams
    from llmserve.structured_output import StructuredOutputManager

    torch.set_num_threads(2)
    rows, record, index = [], {}, {}
    document = json.dumps({"notes": [f"note number {i}" for i in range(30)]})
    for name in args.tokenizers:
        tokenizer = load_tokenizer(name)
        vocab = {"smollm2-135m": 49152}.get(name, 151936)  # the models' embedding rows (Qwen2.5's: 151,936)
        manager = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id])
        t = time.perf_counter()
        manager.compile(StructuredOutputsParams(json={"type": "object"}))
        index_s = time.perf_counter() - t  # the tokenizer's index, built once, plus a first tiny grammar
        for schema_name in args.schemas:
            spec = StructuredOutputsParams(json=NOTES_SCHEMAS[schema_name])
            cold = _time_us(partial(manager.compile, spec), 1)
            cached = _time_us(partial(manager.compile, spec), 50)
            ids = tokenizer.encode(document, add_special_tokens=False)
            for batch in (1, 8, 32):
                masks_us, apply_us = _mask_costs(manager, spec, ids, batch, vocab, _apply_token_bitmask)
                record[f"{name}/{schema_name}/{batch}"] = {
                    "index_s": index_s, "compile_cold_us": cold, "compile_cached_us": cached, "masks_us": masks_us,
                    "apply_us": apply_us}
                rows.append([name, schema_name, str(batch), f"{cold / 1000:.2f}", f"{cached:.1f}", f"{masks_us:.0f}",
                             f"{masks_us / batch:.1f}", f"{apply_us:.0f}"])
        index[name] = index_s
    body = ("Through the engine's own parts: `StructuredOutputManager.compile` (the schemas of the neighbours part: "
            "cold = first compile, cached = again), `bitmasks` for a batch of matchers a third of the way through a "
            "document (a new state each time), and the sampler's `_apply_token_bitmask` on float32 logits [batch, "
            "vocab]. Medians; torch on 2 threads.\n\n"
            + render_table(["tokenizer", "schema", "batch", "compile cold ms", "compile cached us", "masks us (batch)",
                            "masks us per row", "apply us (batch)"], rows, markdown=True)
            + "\n\nBuilding the tokenizer's index (once per server, in the background at start): "
            + ", ".join(f"{seconds:.2f} s ({name})" for name, seconds in index.items()) + ".")
    return body, record


# --- quality -------------------------------------------------------------------------------------


def _unfenced(text: str) -> str:
    """The text inside a markdown code fence, if the output is one (how chat models like to write JSON)."""
    stripped = text.strip()
    if stripped.startswith("```") and stripped.endswith("```"):
        return stripped.split("\n", 1)[-1].rsplit("```", 1)[0]
    return text


def _follows(text: str) -> tuple[bool, bool]:
    """(valid JSON, valid JSON following ANSWER_SCHEMA)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, ANSWER_SCHEMA)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def part_quality(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    from llmserve import LLM, SamplingParams
    from llmserve.sampling_params import StructuredOutputsParams

    path = find_mtbench_questions()
    questions = [json.loads(line)["turns"][0] for line in path.read_text().splitlines()[: args.questions]]
    llm = LLM(args.quality_model)
    instruction = ("Answer the question below. Reply with a JSON object only, following this JSON schema:\n"
                   f"{json.dumps(ANSWER_SCHEMA)}\n\nQuestion: ")
    prompts = [llm.engine.processor.encode_chat([{"role": "user", "content": instruction + q}]) for q in questions]
    record: dict[str, Any] = {}
    rows = []
    for name, constraint in (("prompt only", None), ("response_format json_schema",
                                                      StructuredOutputsParams(json=ANSWER_SCHEMA))):
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        texts = [o.outputs[0].text for o in outs]
        checks = [_follows(t) for t in texts]
        lenient = [_follows(_unfenced(t)) for t in texts]
        record[name] = {"texts": texts, "valid_json": sum(c[0] for c in checks),
                        "follows_schema": sum(c[1] for c in checks), "valid_json_unfenced": sum(c[0] for c in lenient),
                        "follows_schema_unfenced": sum(c[1] for c in lenient), "seconds": seconds,
                        "finish_reasons": [o.outputs[0].finish_reason for o in outs]}
        rows.append([name, f"{sum(c[0] for c in checks)}/{len(texts)}", f"{sum(c[1] for c in checks)}/{len(texts)}",
                     f"{sum(c[0] for c in lenient)}/{len(texts)}", f"{sum(c[1] for c in lenient)}/{len(texts)}",
                     f"{sum(len(o.outputs[0].token_ids) for o in outs) / len(outs):.0f}", f"{seconds:.0f}"])
    body = (f"{args.quality_model} (default flags), the first {len(questions)} MT-Bench questions, each asked for a "
            f"JSON answer following a schema given in the prompt (answer, confidence in [0, 1], 1-4 topics); greedy, "
            f"at most {args.max_tokens} tokens. Valid = the whole output parses as JSON.\n\n"
            + render_table(["decoding", "valid JSON", "follows the schema", "valid, code fence removed",
                            "follows, code fence removed", "mean output tokens", "wall s"], rows, markdown=True))
    return body, record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="masks,neighbours,quality")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--schemas", type=lambda s: s.split(","), default=["plain", "bounded"],
                    help="neighbours: which constraint the JSON streams carry; masks: the last one")
    ap.add_argument("--seconds", type=float, default=30.0, help="neighbours: measured seconds a run")
    ap.add_argument("--port", type=int, default=8070)
    ap.add_argument("--tokenizers", type=lambda s: s.split(","), default=["smollm2-135m", "qwen2.5-coder-0.5b"],
                    help="masks: the registered models whose tokenizers are measured (default: %(default)s)")
    ap.add_argument("--quality-model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out-dir", type=Path, default=None, help="default benchmarks/results/structured-outputs/<host>")
    args = ap.parse_args()
    args.out_dir = args.out_dir or REPO / "benchmarks" / "results" / "structured-outputs" / host_tag()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    m = machine_facts()
    parts = {"neighbours": part_neighbours, "masks": part_masks, "quality": part_quality}
    for part in args.parts.split(","):
        body, record = parts[part](args)
        report = (f"# Structured outputs: {part}\n\nGenerated {time.strftime('%Y-%m-%d %H:%M')} by "
                  f"`benchmarks/structured_outputs.py --parts {part}`; {m['cpu']}, {m['cpus']} CPUs.\n\n{body}\n")
        (args.out_dir / f"{part}.md").write_text(report)
        (args.out_dir / f"{part}.json").write_text(json.dumps(record, indent=1))
        print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
