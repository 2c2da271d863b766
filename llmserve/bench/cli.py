"""`llmserve bench`: load-test any OpenAI-compatible server; `llmserve bench compare A.json B.json ...`.

Talks HTTP only (no engine, no torch), so it measures llmserve and its peers the same way.

Exit status: 0 when at least one measured request succeeded, even if others failed (their errors are
counted by kind and reported: a benchmark of a flaky server is still a result); 1 when every measured
request failed (unreachable URL, not an OpenAI server, ...); 2 for bad arguments or input files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from llmserve.bench.client import ENDPOINTS, ClientConfig, detect_model
from llmserve.bench.metrics import parse_slo
from llmserve.bench.report import (
    build_document,
    compare_table,
    file_labels,
    format_report,
    level_label,
    load_result,
    plot_results,
    write_json,
)
from llmserve.bench.runner import BenchmarkResult, LevelResult, RunConfig, plan_levels, run_benchmark
from llmserve.bench.tokens import TokenizerLoadError, load_token_counter
from llmserve.bench.workload import WORKLOADS, WorkloadConfig, make_workload

EPILOG = """examples:
  llmserve bench --base-url http://127.0.0.1:8000 --concurrency 1,4,16 --num-requests 32 --out r.json
  llmserve bench --workload shared-prefix --tokenizer ~/models/smollm2 --request-rate 2,4 --duration 30
  llmserve bench --workload chat --slo ttft=200ms,tpot=50ms --plot r.png
  llmserve bench compare a.json b.json
exit status: 0 if any measured request succeeded, 1 if all failed, 2 on bad arguments."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16: {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16: {text!r}")
    return values


def _rate_list(text: str) -> list[float]:
    try:
        values = [math.inf if x.strip().lower() == "inf" else float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected rates like 1,2.5,inf: {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive rates like 1,2.5,inf: {text!r}")
    return values


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `llmserve bench`, plus the nested `compare` action."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.epilog = EPILOG
    actions = parser.add_subparsers(dest="bench_action", metavar="[compare]")
    cmp = actions.add_parser("compare", help="side-by-side table (with ratios) of result files from --out",
                             description="Compare result files of `llmserve bench --out` (or peerbench "
                                         "loadgen.py): per level and metric, with ratios to the first file.")
    cmp.add_argument("files", nargs="+", help="two or more result JSON files; the first is the baseline (a)")
    cmp.add_argument("--markdown", action="store_true", help="print a markdown table")
    cmp.add_argument("--plot", dest="compare_plot", metavar="PNG", help="also plot all files into one PNG")

    t = parser.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, with or without /v1 (default %(default)s)")
    t.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    t.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat",
                   help="chat = /v1/chat/completions, completions = /v1/completions (default %(default)s)")
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    t.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per request, connect to last byte (default %(default)s)")
    t.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos=true (sent by default so all outputs get --output-len "
                        "tokens; dropped automatically if the first warm-up request is refused with 400/422)")
    t.add_argument("--no-usage", dest="include_usage", action="store_false",
                   help="do not ask for stream_options.include_usage")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="merged into every request body, e.g. '{\"logit_bias\": {\"2\": -100}}'")
    t.add_argument("--keepalive", action="store_true",
                   help="reuse HTTP connections (default: a fresh connection per request)")

    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random", help="default %(default)s")
    w.add_argument("--tokenizer", default=None, metavar="PATH_OR_NAME",
                   help="tokenizer.json, model dir or cached hub name (offline) for exact token counts; "
                        "without it lengths are approximate")
    w.add_argument("--input-len", type=int, default=256, help="prompt tokens (default %(default)s)")
    w.add_argument("--input-len-range", type=float, default=0.0, metavar="R",
                   help="draw prompt lengths uniformly in input-len*[1-R, 1+R] (default 0: fixed)")
    w.add_argument("--output-len", type=int, default=128, help="max_tokens (default %(default)s)")
    w.add_argument("--output-len-range", type=float, default=0.0, metavar="R")
    w.add_argument("--prefix-len", type=int, default=200,
                   help="shared-prefix: shared system prompt tokens, at least (default %(default)s)")
    w.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: distinct system prompts, each request drawing one (default %(default)s)")
    w.add_argument("--long-input-len", type=int, default=2048, help="long-prompt-mix (default %(default)s)")
    w.add_argument("--long-fraction", type=float, default=0.1, help="long-prompt-mix (default %(default)s)")
    w.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                   help="chat: prompts (messages/prompt/turns/conversations per line); default MT-Bench")
    w.add_argument("--seed", type=int, default=1234)

    ld = parser.add_argument_group("load")
    ld.add_argument("--concurrency", type=_int_list, default=None, metavar="C1,C2,...",
                    help="closed-loop levels (default 1,8,32)")
    ld.add_argument("--request-rate", type=_rate_list, default=None, metavar="R1,R2,...",
                    help="open-loop levels in requests/s (inf = all at once) instead of --concurrency")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier (default 1)")
    ld.add_argument("--max-concurrency", type=int, default=None, help="cap in-flight requests (open loop)")
    ld.add_argument("--num-requests", type=_int_list, default=None, metavar="N or N1,N2,...",
                    help="requests per level (default max(8, 2*c); open loop ~10 s of arrivals)")
    ld.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                    help="run each level this long instead of a request count")
    ld.add_argument("--warmup", type=int, default=2, help="sequential warm-up requests (default 2)")
    ld.add_argument("--slo", default=None, metavar="ttft=200ms,tpot=50ms",
                    help="goodput = requests/s meeting all of these (ttft, tpot, itl, e2e)")

    o = parser.add_argument_group("output")
    o.add_argument("--out", default=None, metavar="FILE.json", help="write results JSON (updated per level)")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="throughput and latency plot")
    o.add_argument("--label", default=None, help="name of this run in reports (default host:port)")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _err(msg: str) -> int:
    print(f"llmserve bench: error: {msg}", file=sys.stderr)
    return 2


def run_compare(args: argparse.Namespace) -> int:
    try:
        docs = [load_result(p) for p in args.files]
        print(compare_table(docs, args.files, markdown=args.markdown))
        if args.compare_plot:
            plot_results(docs, args.compare_plot, file_labels(docs, args.files))
            print(f"wrote {args.compare_plot}")
    except (OSError, ValueError) as exc:
        return _err(str(exc))
    return 0


def _config_json(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if not callable(v)}
    if cfg.get("api_key"):
        cfg["api_key"] = "***"
    return json.loads(json.dumps(cfg, default=str))


def run(args: argparse.Namespace) -> int:
    """Entry point called by `llmserve bench`."""
    if getattr(args, "bench_action", None) == "compare":
        return run_compare(args)
    if args.concurrency and args.request_rate:
        return _err("give --concurrency (closed loop) or --request-rate (open loop), not both; "
                    "cap open-loop parallelism with --max-concurrency")
    try:
        counter = load_token_counter(args.tokenizer)
    except TokenizerLoadError as exc:
        return _err(str(exc))
    wcfg = WorkloadConfig(name=args.workload, input_len=args.input_len, input_len_range=args.input_len_range,
                          output_len=args.output_len, output_len_range=args.output_len_range,
                          prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                          long_input_len=args.long_input_len,
                          long_fraction=args.long_fraction, dataset=args.dataset, seed=args.seed,
                          chat=args.endpoint == "chat")
    try:
        workload = make_workload(wcfg, counter)
        rcfg = RunConfig(concurrency=args.concurrency or [1, 8, 32], request_rates=args.request_rate,
                         burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                         num_requests=args.num_requests, duration_s=args.duration, warmup=args.warmup,
                         seed=args.seed, progress=args.progress, slo=parse_slo(args.slo))
        plan_levels(rcfg)
    except (OSError, ValueError) as exc:
        return _err(str(exc))
    if args.burstiness <= 0:
        return _err("--burstiness must be > 0")

    notes: list[str] = []
    model = args.model or asyncio.run(
        detect_model(args.base_url, args.api_key, min(10.0, args.request_timeout)))
    if model is None:
        model = "default"
        notes.append("model not given and GET /v1/models did not name one: sending model='default'")
    if not counter.exact:
        notes.append("no --tokenizer: prompt lengths and tokens per stream chunk are APPROXIMATE "
                     "(1 word or punctuation mark = 1 token); output token totals use the server's usage "
                     "when it sends it")
    notes += [n for n in counter.notes if n]
    client_cfg = ClientConfig(base_url=args.base_url, model=model, endpoint=args.endpoint,
                              api_key=args.api_key, request_timeout=args.request_timeout,
                              ignore_eos=args.ignore_eos, include_usage=args.include_usage,
                              temperature=args.temperature, extra_body=args.extra_body,
                              keepalive=args.keepalive)
    label = args.label or (urlsplit(args.base_url).netloc or args.base_url)
    desc = workload.describe()
    print(f"[bench] {label}: {client_cfg.url} model={model} workload={args.workload} "
          f"tokens={counter.description}", flush=True)
    for n in notes:
        print(f"[bench] note: {n}", flush=True)

    started = time.time()
    done: list[LevelResult] = []

    def on_level(res: LevelResult) -> None:
        s = res.summary
        errs = ", ".join(f"{k} x{v}" for k, v in s["errors_by_kind"].items()) or "none"
        tok_s = s["output_tok_per_s"] or 0.0
        ttft = s["ttft_p50_ms"]
        print(f"[bench] {level_label(s)}: {s['num_ok']}/{s['num_requests']} ok, {tok_s:.1f} out tok/s, "
              f"TTFT p50 {ttft if ttft is None else round(ttft)} ms, errors: {errs}", flush=True)
        done.append(res)
        if args.out:  # keep a usable file even if a later level is interrupted
            partial = BenchmarkResult([], list(done), notes, client_cfg)
            doc = build_document(partial, label=label, config=_config_json(args), workload=desc,
                                 started_unix=started, finished_unix=time.time())
            doc["complete"] = False
            write_json(args.out, doc)

    try:
        result = asyncio.run(
            run_benchmark(client_cfg, counter, workload, rcfg, on_level=on_level, notes=notes))
    except KeyboardInterrupt:
        where = f"; finished levels are in {args.out}" if args.out and done else ""
        print(f"\n[bench] interrupted{where}", file=sys.stderr)
        return 130
    doc = build_document(result, label=label, config=_config_json(args), workload=desc, started_unix=started,
                         finished_unix=time.time())
    doc["complete"] = True
    print()
    print(format_report(doc))
    if args.out:
        write_json(args.out, doc)
        print(f"[bench] wrote {args.out}")
    if args.plot:
        plot_results([doc], args.plot, [label])
        print(f"[bench] wrote {args.plot}")
    if result.all_failed:
        print("[bench] every measured request failed", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmserve bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
