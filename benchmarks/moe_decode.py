#!/usr/bin/env python3
"""Decode speed of a mixture-of-experts model against the dense model of the same active size.

    .venv/bin/python benchmarks/moe_decode.py                          # ~3 minutes on a quiet 2-core host
    .venv/bin/python benchmarks/moe_decode.py --hidden 64 --layers 2 --heads 4 --kv-heads 2 --experts 4 \
        --expert-intermediate 32 --output-len 4 --concurrency 1 2 --rounds 1 --out-dir /tmp/moe   # a smoke run

Why: a token of a top-k MoE model passes through k experts, so it does as much arithmetic as a dense model whose MLP
is k experts wide, and at one request it reads about as many weight bytes. Whether its decode steps are as fast is
a matter of how the engine runs experts (docs/performance.md, "Mixture of experts"); this measures it.

Two models are built here with random weights (a step's time does not depend on the values), as Hugging Face
directories with the default model's tokenizer: a Mixtral (`--experts` experts of `--expert-intermediate` hidden
units, `--top-k` a token) and a Llama of the same hidden size, layers and heads whose MLP is top-k x the expert's
width: the same active parameters per token. Each runs under `LLM(...)`'s defaults, bfloat16 "as loaded" (what
`quantization="auto"` keeps for a dense checkpoint) and `quantization="int4"`, with two changes that say why:

- speculation off: `auto` turns on n-gram prompt lookup where the one-call decode stack runs (both models under
  int4), and a random model's greedy output repeats itself, so its proposals would be accepted at a rate no real
  model sees. `--speculation auto` leaves the default.
- a small KV cache (`--kv-cache-gb`): the engines of the run live in one process, and a step's time does not depend
  on the pool's size once the requests fit.

Under int4 each model is also run with the one-call stack off ("layer by layer", the same engine with its plan's
one-call route switched off): the gap between the two is the one-call stack's, the gap between the models the
experts'.

Per concurrency c, c requests (distinct fixed short prompts, so their tokens route apart) generate `--output-len`
tokens each, greedy with `ignore_eos`; decode tokens/s over the steps after every request has its first token. A
warm-up run of each first (it also counts how many distinct experts a layer runs per decode step), then
`--rounds` rounds in which the MoE and dense runs alternate. Beside each run, the share of the cores' time other
processes took meanwhile (/proc/stat less this process's CPU time): on a shared host a layer-by-layer step slows
many times over when another process holds a core, the one-call step far less, so the medians are of the runs
that overlapped little other work (`--quiet-below`), and the report says how many those were. Writes decode.md,
decode.json and decode.png under --out-dir (default benchmarks/results/moe).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.host import cpu_model  # noqa: E402
from llmserve.layers.moe import SparseMoE  # noqa: E402
from llmserve.loader import load_tokenizer  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from bench_vs_peers import host_tag  # noqa: E402

# Distinct prompts, so the c requests of a step decode different tokens and their routers pick apart; identical
# greedy requests would all take the same two experts and hide what a batch costs a MoE.
PROMPTS = [
    "The history of the printing press begins",
    "A recipe for bread needs flour, water and",
    "def quicksort(items):",
    "The three largest moons of Jupiter are",
    "Dear team, the meeting on Thursday",
    "In 1969 the first people to walk on the moon",
    "SELECT name, count(*) FROM orders",
    "Honey bees communicate by dancing, which",
]
QUANTIZATIONS = {"auto": "as loaded (bf16)", "int4": "int4"}
MODEL_LABELS = {"moe": "MoE", "moe-layered": "MoE, layer by layer", "dense": "dense",
                "dense-layered": "dense, layer by layer"}


def build(kind: str, args: argparse.Namespace, folder: Path, tokenizer) -> dict[str, Any]:
    """A Mixtral ("moe") or Llama ("dense") of the asked shape with random weights, saved to folder/kind with the
    tokenizer; its directory and parameter counts."""
    import transformers

    common = dict(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=1_000_000.0, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)
    if kind == "moe":
        config = transformers.MixtralConfig(**common, intermediate_size=args.expert_intermediate,
                                            num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                                            sliding_window=None)
    else:
        config = transformers.LlamaConfig(**common, intermediate_size=args.top_k * args.expert_intermediate)
    start = time.perf_counter()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * args.hidden * args.expert_intermediate  # gate, up and down
    idle = args.layers * (args.experts - args.top_k) * expert if kind == "moe" else 0
    embedding = model.get_input_embeddings().weight.numel()
    path = folder / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    print(f"built {kind}: {total / 1e6:.1f}M parameters, {(total - idle) / 1e6:.1f}M active a token, "
          f"in {time.perf_counter() - start:.1f}s", flush=True)
    return {"path": str(path), "params_total": total, "params_active": total - idle, "params_embedding": embedding,
            "params_experts": args.layers * args.experts * expert if kind == "moe" else 0,
            "experts": args.experts if kind == "moe" else 0,
            "bytes_as_loaded": 2 * total}


def quantized_bytes(llm: LLM) -> tuple[int, int]:
    """(all weight bytes, the experts' share) of an int4 engine's model: its tensors (packed int4 linears with
    their scales, the int8 output head, the bf16 embedding, norms and routers)."""
    total = experts = 0
    for name, tensor in llm.engine.runner.model.state_dict().items():
        total += tensor.nbytes
        experts += tensor.nbytes if ".experts." in name else 0
    return total, experts


def step_bytes(info: dict[str, Any], fmt: str, experts_run: float) -> float:
    """Weight bytes a decode step reads: everything but the embedding table (a token reads one row of it) and the
    experts no token of the step picked (`experts_run` of each layer's experts do run; a dense model has none)."""
    total, in_experts, num_experts = info["bytes"][fmt], info["expert_bytes"][fmt], info["experts"]
    unread = in_experts * (1 - experts_run / num_experts) if num_experts else 0
    return total - 2 * info["params_embedding"] - unread


def set_one_call(llm: LLM, plan: Any) -> None:
    """Give the engine and its runner this plan (the one-call route on or off): both read it at every step."""
    llm.engine.plan = llm.engine.runner.plan = plan


def decode_run(llm: LLM, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, int]:
    """(decode tokens/s, decode steps) of the requests run together: stepped until every request has its first
    token, then the remaining steps timed (all decode steps, each one token a request)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    requests = [engine.requests[i] for i in ids]
    while any(not r.output_token_ids for r in requests):
        engine.step()
    before, steps = sum(len(r.output_token_ids) for r in requests), 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    return (len(prompts) * output_len - before) / elapsed, steps


class ExpertCount:
    """Counts, over the decode steps of `size` tokens, how many distinct experts each MoE layer's router picks."""

    def __init__(self, llm: LLM, size: int) -> None:
        self.size, self.counts = size, []
        self.hooks = [m.gate.register_forward_hook(self._record(m.top_k)) for m in llm.engine.runner.model.modules()
                      if isinstance(m, SparseMoE)]

    def _record(self, top_k: int):
        def hook(module, args, logits):
            if logits.shape[0] == self.size:
                self.counts.append(len(torch.unique(logits.topk(top_k, dim=-1).indices)))
        return hook

    def close(self) -> float | None:
        for hook in self.hooks:
            hook.remove()
        return statistics.mean(self.counts) if self.counts else None


def _cpu_busy_s() -> float | None:
    """Seconds all CPUs have spent not idle since boot (/proc/stat; steal counts: another guest had the core)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OtherWork:
    """The share of the cores' time that other processes (or the hypervisor) took while a run ran: on a shared
    host a run that overlaps other work is slowed by far more than its share (a layer-by-layer step's ~30 fork/joins
    a layer each wait for a thread the scheduler took off its core), so such runs are told apart."""

    def __enter__(self) -> OtherWork:
        self.busy, self.mine, self.wall = _cpu_busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy, wall = _cpu_busy_s(), time.perf_counter() - self.wall
        self.share = None if busy is None or self.busy is None else max(
            0.0, (busy - self.busy - (time.process_time() - self.mine)) / (wall * (os.cpu_count() or 1)))


def measure(variants: dict[tuple[str, str], tuple[LLM, Any]], prompts: list[list[int]], levels: list[int],
            output_len: int, rounds: int) -> tuple[dict, dict]:
    """Per (quantization, c, model): each round's decode tokens/s and the other work during it, after a warm-up
    run; MoE and dense alternate within each (quantization, c). Also the experts a MoE layer runs per decode step,
    per (quantization, c), counted in the warm-up of a layer-by-layer MoE run (the one call has no Python router to
    hook)."""
    runs: dict[str, dict[str, dict[str, list[dict[str, float | None]]]]] = {}
    experts_run: dict[str, dict[str, float | None]] = {}
    order = [(q, c, m) for q in QUANTIZATIONS for c in levels for m in MODEL_LABELS if (q, m) in variants]
    for r in range(-1, rounds):
        label = "warm-up" if r < 0 else f"round {r + 1}/{rounds}"
        for q, c, m in order:
            llm, plan = variants[(q, m)]
            set_one_call(llm, plan)
            counted = "moe-layered" if (q, "moe-layered") in variants else "moe"
            counter = ExpertCount(llm, c) if r < 0 and m == counted else None
            with OtherWork() as other:
                rate, steps = decode_run(llm, prompts[:c], output_len, f"{q}-{c}-{m}-{r}")
            if counter is not None:
                experts_run.setdefault(q, {})[str(c)] = counter.close()
            if r >= 0:
                runs.setdefault(q, {}).setdefault(str(c), {}).setdefault(m, []).append(
                    {"tok_s": rate, "other_work": other.share})
            others = "" if other.share is None else f", other work {100 * other.share:.0f} % of the cores"
            print(f"  {label:11s} {QUANTIZATIONS[q]:16s} c={c:<3d} {MODEL_LABELS[m]:22s} {rate:8.1f} tok/s "
                  f"({1e3 * c / rate:.1f} ms a step, {steps} steps{others})", flush=True)
    return runs, experts_run


def summarize(runs: dict, experts_run: dict, quiet_below: float) -> list[dict[str, Any]]:
    """Per (quantization, c): each model's median tokens/s over its quiet runs (other work under `quiet_below` of
    the cores; all its runs where none was), MoE / dense from the medians, and the ratios of the rounds in which
    both ran quiet (back to back, so a host slowed for a while slows both alike)."""
    def quiet(run: dict) -> bool:
        return run["other_work"] is None or run["other_work"] < quiet_below

    rows = []
    for q, by_c in runs.items():
        for c, by_model in by_c.items():
            med, kept = {}, {}
            for m, model_runs in by_model.items():
                chosen = [run["tok_s"] for run in model_runs if quiet(run)]
                kept[m] = len(chosen)
                med[m] = statistics.median(chosen or [run["tok_s"] for run in model_runs])
            paired = [a["tok_s"] / b["tok_s"] for a, b in zip(by_model["moe"], by_model["dense"], strict=True)
                      if quiet(a) and quiet(b)]
            row = {"quantization": q, "weights": QUANTIZATIONS[q], "concurrency": int(c),
                   **{f"{m}_tok_s": v for m, v in med.items()}, "quiet_runs": kept,
                   "moe_over_dense": med["moe"] / med["dense"], "moe_over_dense_quiet_rounds": paired,
                   "experts_run_per_layer": experts_run.get(q, {}).get(c)}
            if "dense-layered" in med:
                row["moe_over_dense_layered"] = med["moe"] / med["dense-layered"]
                row["dense_layered_over_dense"] = med["dense-layered"] / med["dense"]
            if "moe-layered" in med:
                row["moe_over_moe_layered"] = med["moe"] / med["moe-layered"]
            rows.append(row)
    return rows


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def markdown(result: dict[str, Any]) -> str:
    a, models = result["args"], result["models"]
    shape = (f"{a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads / {a['kv_heads']} KV heads, "
             f"vocabulary {result['vocab_size']:,} (untied head)")
    lines = [f"# MoE decode against the dense model of the same active size ({result['host']}, {result['date']})",
             "", f"Both models: {shape}. Random weights; `LLM(...)` defaults but speculation "
             f"{result['speculation']}; {a['output_len']} output tokens a request, greedy, `ignore_eos`; medians of "
             f"the quiet runs (other processes under {100 * a['quiet_below']:.0f} % of the cores' time) of "
             f"{a['rounds']} rounds after a warm-up, MoE and dense alternated.", "",
             "| model | MLP | parameters | active a token | weights as loaded | int4 | a 1-token step reads "
             f"({' / '.join(QUANTIZATIONS[q] for q in a['quantizations'])}) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    mlps = {"moe": f"{a['experts']} experts x {a['expert_intermediate']}, top-{a['top_k']}",
            "dense": f"{a['top_k'] * a['expert_intermediate']}"}
    for kind in ("moe", "dense"):
        info = models[kind]
        lines.append(f"| {MODEL_LABELS[kind]} | {mlps[kind]} | {info['params_total'] / 1e6:.1f}M | "
                     f"{info['params_active'] / 1e6:.1f}M | {_mb(info['bytes']['auto'])} | "
                     f"{_mb(info['bytes']['int4']) if 'int4' in info['bytes'] else '-'} | "
                     f"{' / '.join(_mb(step_bytes(info, q, a['top_k'])) for q in a['quantizations'])} |")
    lines += ["", "Decode tokens/s (all requests together):", "",
              "| weights | c | MoE | dense | **MoE / dense** (quiet rounds) | MoE, layer by layer "
              "| dense, layer by layer | experts a MoE layer runs a step | MoE step reads | quiet runs |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        q, c = row["quantization"], str(row["concurrency"])
        runs = row["experts_run_per_layer"]
        layered_cells = " | ".join(f"{row[f'{m}-layered_tok_s']:.1f}" if f"{m}-layered_tok_s" in row else "-"
                                   for m in ("moe", "dense"))
        runs_cell = f"{runs:.2f} of {a['experts']}" if runs else "-"
        quiet_cell = ", ".join(f"{MODEL_LABELS[m]} {n}/{a['rounds']}" for m, n in row["quiet_runs"].items())
        paired = row["moe_over_dense_quiet_rounds"]
        spread = f" ({min(paired):.2f}-{max(paired):.2f})" if len(paired) > 1 else ""
        lines.append(f"| {row['weights']} | {c} | {row['moe_tok_s']:.1f} | {row['dense_tok_s']:.1f} | "
                     f"**{row['moe_over_dense']:.2f}**{spread} | {layered_cells} | "
                     f"{runs_cell} | "
                     f"{_mb(step_bytes(models['moe'], q, runs or a['top_k']))} "
                     f"(dense {_mb(step_bytes(models['dense'], q, 0))}) | "
                     f"{quiet_cell} |")
    lines += ["", "Under int4 both models' decode steps run as one native call, unless \"layer by layer\" (the same "
              "engine with its plan's one-call route off). A step reads each expert any of its tokens picked.", "",
              f"```\n{result['command']}\n```"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """PNG: one panel per weight format, decode tokens/s per concurrency, a bar per model; MoE / dense over the
    MoE bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(row["quantization"] for row in result["rows"]))
    fig, axes = plt.subplots(1, len(formats), figsize=(6.5 * len(formats), 4.5), squeeze=False)
    for ax, q in zip(axes[0], formats, strict=True):
        rows = [row for row in result["rows"] if row["quantization"] == q]
        models = [m for m in MODEL_LABELS if any(f"{m}_tok_s" in row for row in rows)]
        width = 0.8 / len(models)
        for j, m in enumerate(models):
            xs = [i + (j - (len(models) - 1) / 2) * width for i in range(len(rows))]
            ys = [row.get(f"{m}_tok_s", 0) for row in rows]
            ax.bar(xs, ys, width, color=f"C{j}", label=MODEL_LABELS[m])
            if m == "moe":
                for x, y, row in zip(xs, ys, rows, strict=True):
                    ax.annotate(f"{row['moe_over_dense']:.2f}x", (x, y), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [f"c={row['concurrency']}" for row in rows])
        ax.set_title(f"weights {QUANTIZATIONS[q]}", fontsize=10)
        ax.set_ylabel("decode tok/s (higher is better)")
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    a = result["args"]
    fig.suptitle(f"MoE ({a['experts']} experts, top-{a['top_k']}) vs dense of the same active size, "
                 f"{result['host']} ({result['threads']} threads); over the MoE bars: MoE / dense", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-intermediate", type=int, default=1408,
                    help="an expert's hidden units; the dense MLP's are top-k times as many (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5,
                    help="measured rounds (default: %(default)s: on a shared host a median of 5 outlasts two "
                    "disturbed rounds)")
    ap.add_argument("--quantizations", nargs="+", default=list(QUANTIZATIONS), choices=list(QUANTIZATIONS))
    ap.add_argument("--speculation", default="off", choices=["off", "auto"],
                    help="speculative decoding: off (default; see above) or the engine's auto")
    ap.add_argument("--kv-cache-gb", type=float, default=0.25, help="each engine's KV cache (default: %(default)s)")
    ap.add_argument("--quiet-below", type=float, default=0.1,
                    help="a run counts where other processes took less than this share of the cores' time while it "
                    "ran (default: %(default)s); a model with no such run is summarized from all of its runs")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "moe")
    args = ap.parse_args(argv)
    if max(args.concurrency) > len(PROMPTS):
        ap.error(f"--concurrency: at most {len(PROMPTS)} (one distinct prompt a request)")
    wall, load_before = time.perf_counter(), os.getloadavg()[0]
    tokenizer = load_tokenizer(None)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    options = dict(kv_cache_memory_gb=args.kv_cache_gb, speculative_config=args.speculation)
    variants: dict[tuple[str, str], tuple[LLM, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="moe-decode-") as folder:
        models = {kind: build(kind, args, Path(folder), tokenizer) for kind in ("moe", "dense")}
        for kind, info in models.items():
            info["bytes"], info["expert_bytes"], info["plans"] = {}, {}, {}
            for q in args.quantizations:
                start = time.perf_counter()
                llm = LLM(info["path"], quantization=q, **options)
                plan = llm.engine.plan
                route = "one native call" if plan.fused_decode_max_tokens else "layer by layer"
                print(f"loaded {kind} {QUANTIZATIONS[q]} in {time.perf_counter() - start:.1f}s: weights "
                      f"{plan.weights}, decode steps {route}", flush=True)
                info["plans"][q] = {"weights": plan.weights, "decode_steps": route,
                                    "speculation": plan.speculative.method if plan.speculative else "off"}
                variants[(q, kind)] = (llm, plan)
                if q == "auto":  # the checkpoint's bf16 tensors, which the engine holds as they are
                    info["bytes"][q], info["expert_bytes"][q] = info["bytes_as_loaded"], 2 * info["params_experts"]
                else:
                    info["bytes"][q], info["expert_bytes"][q] = quantized_bytes(llm)
                if plan.fused_decode_max_tokens:
                    # the same engine, its plan's one-call route off (set before each of its runs, and the default
                    # plan back before the default's runs)
                    variants[(q, f"{kind}-layered")] = (llm, dataclasses.replace(plan, fused_decode_max_tokens=0))
        print(f"decode: {args.output_len} tokens a request, c in {args.concurrency}, {args.rounds} rounds",
              flush=True)
        runs, experts_run = measure(variants, prompts, args.concurrency, args.output_len, args.rounds)
    for info in models.values():
        info.pop("path")
    result = {"host": cpu_model() or host_tag(), "host_tag": host_tag(), "date": time.strftime("%Y-%m-%d"),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "vocab_size": len(tokenizer),
              "speculation": args.speculation, "args": {k: str(v) if isinstance(v, Path) else v
                                                        for k, v in vars(args).items()},
              "command": " ".join(["python benchmarks/moe_decode.py", *(sys.argv[1:] if argv is None else argv)]),
              "models": models, "rows": summarize(runs, experts_run, args.quiet_below), "runs": runs,
              "wall_s": round(time.perf_counter() - wall, 1),
              # other work on a shared host's cores slows every run it overlaps: the 1-minute load before and after
              "load_avg_before_after": [load_before, os.getloadavg()[0]]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "decode.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out_dir / "decode.md").write_text(md)
    plot(result, args.out_dir / "decode.png")
    print(md)
    print(f"wrote {args.out_dir}/decode.{{md,json,png}} in {result['wall_s']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
