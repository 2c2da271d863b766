"""`llmserve plan`: will it fit, how many replicas meet the SLO, what it costs, and where an API is cheaper.

The machine is described by a `llmserve bench` result measured on it (a step-time model is fitted to
it) or by its spec sheet (--hardware preset and/or --mem-bandwidth-gbs --tflops --memory-gb), which
gives a roofline estimate. No torch, no model weights: only the GGUF header of a registered model.

Exit status: 0 with a plan, 1 when nothing fits or a request alone misses the SLO, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from llmserve.bench.metrics import parse_duration
from llmserve.bench.report import render_table
from llmserve.plan.cost import API_PRICES, ApiPrice, parse_api_price
from llmserve.plan.fit import StepFit, fit_step_model
from llmserve.plan.hardware import PRESETS, HardwareSpec, hardware
from llmserve.plan.model_spec import KV_DTYPE_BYTES, WEIGHT_FORMATS, ModelSpec, registered_model
from llmserve.plan.planner import SLO, PlanInputs, Replica, SimSettings, make_plan, predict
from llmserve.plan.report import format_plan, plot_plan, write_json
from llmserve.plan.simulator import SchedulerLimits, ServerLatency
from llmserve.plan.step_model import StepModel, roofline_step_model
from llmserve.plan.traffic import DISTRIBUTIONS, SECONDS_PER_DAY, LengthDist, Traffic

EPILOG = """examples:
  llmserve plan --model smollm2-135m --quantization int4 --bench sweep.json --dollars-per-hour 0.08 --rate 2
  llmserve plan --params 8e9 --layers 32 --kv-heads 8 --head-dim 128 --heads 32 --hardware h100-80gb \\
      --requests-per-day 2e6 --prompt-len 1000 --output-len 300 --output-dist exponential --cache-hit-share 0.2 \\
      --slo-ttft 1s --slo-tpot 50ms --max-num-seqs 256 --max-num-batched-tokens 8192 --chunk 8192 \\
      --out plan.json --plot plan.png
exit status: 0 with a plan, 1 when nothing fits or one request alone misses the SLO, 2 on bad arguments."""


def _rates(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected rates like 0.5,1,2: {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive rates like 0.5,1,2: {text!r}")
    return values


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.epilog = EPILOG
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None, help="registered name or GGUF file (its header gives the shape); "
                   "default: the bench file's model, else smollm2-135m; with --params: just the name shown")
    m.add_argument("--params", type=float, default=None, help="parameter count, e.g. 8e9 (instead of a file)")
    m.add_argument("--layers", type=int, default=None)
    m.add_argument("--kv-heads", type=int, default=None)
    m.add_argument("--head-dim", type=int, default=None)
    m.add_argument("--heads", type=int, default=None, help="query heads (attention FLOPs; optional)")
    m.add_argument("--quantization", choices=sorted(WEIGHT_FORMATS), default="bf16",
                   help="weight format: bytes per weight including scales (default %(default)s)")
    m.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_BYTES), default="bf16", help="default %(default)s")

    h = parser.add_argument_group("hardware (a bench result measured on it, or its spec sheet)")
    h.add_argument("--bench", nargs="+", default=None, metavar="FILE.json",
                   help="`llmserve bench --concurrency ...` results: fit the step model to them")
    h.add_argument("--hardware", choices=sorted(PRESETS), default=None, help="spec-sheet preset (memory, bandwidth, "
                   "FLOP/s, example $/hour); the flags below override its figures")
    h.add_argument("--memory-gb", type=float, default=None, help="default: the preset's, else this host's")
    h.add_argument("--mem-bandwidth-gbs", type=float, default=None)
    h.add_argument("--tflops", type=float, default=None, help="dense 16-bit peak")
    h.add_argument("--dollars-per-hour", type=float, default=None, help="one replica's machine")
    h.add_argument("--bandwidth-efficiency", type=float, default=None)
    h.add_argument("--compute-efficiency", type=float, default=None)
    h.add_argument("--step-overhead-ms", type=float, default=None)
    h.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of memory for weights + KV (default %(default)s)")

    t = parser.add_argument_group("traffic")
    t.add_argument("--rate", type=float, default=None, help="requests/s, cache hits included")
    t.add_argument("--requests-per-day", type=float, default=None, help="instead of --rate")
    for name, default in (("prompt", 512), ("output", 128)):
        t.add_argument(f"--{name}-len", type=float, default=default, help=f"mean {name} tokens (default %(default)s)")
        t.add_argument(f"--{name}-dist", choices=DISTRIBUTIONS, default="fixed", help="default %(default)s")
        t.add_argument(f"--{name}-spread", type=float, default=0.5,
                       help="uniform: lengths in mean*[1-S, 1+S] (default %(default)s)")
    t.add_argument("--cache-hit-share", type=float, default=0.0, help="answered by a cache in front (default 0)")

    s = parser.add_argument_group("SLO, scheduler, simulation")
    s.add_argument("--slo-ttft", type=_duration, default=2.0, metavar="DURATION", help="p99 TTFT (default 2s)")
    s.add_argument("--slo-tpot", type=_duration, default=0.1, metavar="DURATION", help="p99 TPOT (default 100ms)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="default %(default)s (llmserve serve's)")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="default %(default)s")
    s.add_argument("--chunk", type=int, default=256, help="largest prompt chunk per request and step "
                   "(long_prefill_token_threshold, default %(default)s)")
    s.add_argument("--max-long-partial-prefills", type=int, default=1,
                   help="prompts longer than a chunk prefilled at once (default %(default)s)")
    s.add_argument("--front-end-ms", type=float, default=None,
                   help="server latency before the engine sees a request (HTTP, template, tokenizer); default: "
                        "fitted from the bench files' concurrency-1 TTFT (with two prompt lengths, apart from the "
                        "prompt's cost), else 0")
    s.add_argument("--wake-ms", type=float, default=None,
                   help="extra time of the first step after the engine idled (a host's idle cores run slower "
                        "for a while); default: fitted from the bench file's request-rate levels, else 0")
    s.add_argument("--num-requests", type=int, default=2000, help="simulated per run (default %(default)s)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--predict-rates", type=_rates, default=None, metavar="R1,R2,...",
                   help="also print one replica's simulated figures at these request rates")

    p = parser.add_argument_group("prices and output")
    p.add_argument("--apis", default="all", help=f"APIs to compare, comma-separated, or all or none "
                   f"({', '.join(API_PRICES)})")
    p.add_argument("--api", action="append", default=[], metavar="NAME=IN,OUT",
                   help="add an API at $ per 1M input and output tokens (repeatable)")
    p.add_argument("--out", default=None, metavar="FILE.json")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="cost per month vs traffic")


def _err(msg: str) -> int:
    print(f"llmserve plan: error: {msg}", file=sys.stderr)
    return 2


def _load_bench(paths: list[str]) -> list[dict[str, Any]]:
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("summary"), list):
            raise ValueError(f"{path}: not a `llmserve bench --out` result")
        docs.append(doc)
    return docs


def _model(args: argparse.Namespace, bench: list[dict[str, Any]]) -> ModelSpec:
    shape = (args.params, args.layers, args.kv_heads, args.head_dim)
    if any(v is not None for v in shape):
        if any(v is None for v in shape):
            raise ValueError("an explicit model needs all of --params --layers --kv-heads --head-dim")
        return ModelSpec(args.model or "custom", args.params, args.layers, args.kv_heads, args.head_dim, args.heads)
    name = args.model or next((d.get("server", {}).get("model") for d in bench), None) or "smollm2-135m"
    return registered_model(name)


def _apis(args: argparse.Namespace) -> tuple[ApiPrice, ...]:
    chosen = args.apis.strip().lower()
    if chosen == "all":
        apis = list(API_PRICES.values())
    elif chosen == "none":
        apis = []
    else:
        unknown = [a for a in chosen.split(",") if a.strip() not in API_PRICES]
        if unknown:
            raise ValueError(f"unknown API {unknown}; known: {', '.join(API_PRICES)} (add one with --api)")
        apis = [API_PRICES[a.strip()] for a in chosen.split(",")]
    return tuple([*apis, *(parse_api_price(a) for a in args.api)])


def build_inputs(args: argparse.Namespace) -> PlanInputs:
    """Every input checked and resolved: bad values raise ValueError (or OSError for files)."""
    if (args.rate is None) == (args.requests_per_day is None):
        raise ValueError("give the traffic as --rate (requests/s) or --requests-per-day, one of them")
    rate = args.rate if args.rate is not None else args.requests_per_day / SECONDS_PER_DAY
    bench = _load_bench(args.bench) if args.bench else []
    model = _model(args, bench)
    hw: HardwareSpec = hardware(args.hardware, memory_gb=args.memory_gb, mem_bandwidth_gbs=args.mem_bandwidth_gbs,
                                tflops=args.tflops, dollars_per_hour=args.dollars_per_hour,
                                bandwidth_efficiency=args.bandwidth_efficiency,
                                compute_efficiency=args.compute_efficiency, step_overhead_ms=args.step_overhead_ms)
    limits = SchedulerLimits(args.max_num_seqs, args.max_num_batched_tokens, args.chunk,
                             args.max_long_partial_prefills)
    fit: StepFit | None = None
    step_model: StepModel
    if bench:
        fit = fit_step_model(bench, limits)
        step_model = fit.model
        if args.hardware is None:
            hw = replace(hw, name="measured (bench)")
    else:
        step_model = roofline_step_model(model, hw, args.quantization, args.kv_dtype)
    if hw.dollars_per_hour <= 0:
        raise ValueError("a price is needed: --dollars-per-hour (or a --hardware preset)")
    traffic = Traffic(rate, LengthDist(args.prompt_len, args.prompt_dist, args.prompt_spread),
                      LengthDist(args.output_len, args.output_dist, args.output_spread), args.cache_hit_share)
    return PlanInputs(model=model, quantization=args.quantization, kv_dtype=args.kv_dtype, hardware=hw,
                      step_model=step_model, traffic=traffic, slo=SLO(args.slo_ttft, args.slo_tpot),
                      limits=limits,
                      apis=_apis(args), sim=SimSettings(num_requests=args.num_requests, seed=args.seed),
                      usable_memory_fraction=args.memory_fraction, fit=fit, latency=_latency(args, fit))


def _latency(args: argparse.Namespace, fit: StepFit | None) -> ServerLatency:
    """The fitted front end and wake-up, each replaced where the user gave one."""
    fitted = fit.latency if fit else ServerLatency()
    return ServerLatency(
        front_end_s=args.front_end_ms / 1e3 if args.front_end_ms is not None else fitted.front_end_s,
        wake_s=args.wake_ms / 1e3 if args.wake_ms is not None else fitted.wake_s, idle_s=fitted.idle_s)


def predictions_table(inputs: PlanInputs, rates: list[float]) -> str:
    rows = []
    replica = Replica(inputs.step_model, inputs.limits, inputs.latency)
    for r in rates:
        s = predict(replica, inputs.traffic.prompt, inputs.traffic.output, r, inputs.sim)
        rows.append([f"{r:g}", f"{s['req_per_s']:.3g}", f"{s['output_tok_per_s']:.1f}", f"{s['ttft_p50_ms']:.0f}",
                     f"{s['ttft_p99_ms']:.0f}", f"{s['tpot_p50_ms'] or 0:.1f}", f"{s['tpot_p99_ms'] or 0:.1f}",
                     f"{s['mean_batch']:.1f}"])
    return render_table(["rate req/s", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                         "TPOT p99 ms", "mean batch"], rows, markdown=True)


def run(args: argparse.Namespace) -> int:
    """Entry point called by `llmserve plan`."""
    try:
        inputs = build_inputs(args)
    except (OSError, ValueError) as exc:
        return _err(str(exc))
    doc = make_plan(inputs)
    print(format_plan(doc))
    if args.predict_rates:
        print("\nOne replica, simulated (Poisson arrivals):\n")
        print(predictions_table(inputs, args.predict_rates))
    if args.out:
        write_json(args.out, doc)
        print(f"\n[plan] wrote {args.out}")
    if args.plot and doc.get("feasible"):
        plot_plan(doc, args.plot)
        print(f"[plan] wrote {args.plot}")
    return 0 if doc.get("feasible") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmserve plan")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
