"""`llmserve eval`: one quality meter for an offline configuration or any OpenAI-compatible server.

    llmserve eval [MODEL] [engine flags]            an offline configuration (the flags of `serve`)
    llmserve eval --base-url http://host:port       a server (vLLM's, llama.cpp's, ours)
        --tasks perplexity,humaneval,agreement --limit 40 --out run.json
    llmserve eval compare A.json B.json             two runs side by side

Perplexity: gensim's Lee corpus (real English news), sliding windows. HumanEval: pass@1, greedy, each
completion in a sandboxed subprocess. Agreement: greedy outputs on MT-Bench questions against a reference
configuration (`--reference "dtype=float32"`, or `--reference-url`).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from llmserve.host import cpu_model

TASKS = ("perplexity", "humaneval", "agreement")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from llmserve.config import add_engine_arguments

    parser.add_argument("model", nargs="?", default=None,
                        help="registered name, GGUF file or HF directory (offline), or `compare`")
    parser.add_argument("files", nargs="*", help="with `compare`: the result files")
    parser.add_argument("--base-url", default=None, help="evaluate this OpenAI-compatible server instead")
    parser.add_argument("--served-model", default=None, help="the server's model name (default: its first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--tokenizer", default=None,
                        help="with --base-url, for perplexity: the model's tokenizer (registered name, GGUF file "
                        "or HF directory)")
    parser.add_argument("--tasks", default="perplexity,humaneval", help=f"some of {','.join(TASKS)}")
    parser.add_argument("--limit", type=int, default=None,
                        help="HumanEval problems and agreement prompts to use (default: all 164 / 40)")
    parser.add_argument("--humaneval-style", default="chat", choices=("chat", "completion"),
                        help="chat: each problem as a user message, the answer's code block run (instruct "
                        "models); completion: the prompt continued as text (base models) (default: %(default)s)")
    parser.add_argument("--window", type=int, default=512, help="perplexity window in tokens")
    parser.add_argument("--stride", type=int, default=256, help="perplexity stride in tokens")
    parser.add_argument("--ppl-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--reference", default="dtype=float32",
                        help="agreement: the reference configuration, as key=value engine options "
                        "(default: %(default)s, the weights as loaded)")
    parser.add_argument("--reference-url", default=None, help="agreement: a server as the reference")
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="with --base-url: requests at a time")
    parser.add_argument("--label", default=None, help="a name for this run in tables (default: the target)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    add_engine_arguments(parser.add_argument_group("engine (offline)"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from llmserve.evaluate.report import compare_table, load, results_table

    if args.model == "compare":
        if len(args.files) != 2:
            print("error: usage: llmserve eval compare A.json B.json", file=sys.stderr)
            return 2
        print(compare_table(load(args.files[0]), load(args.files[1])))
        return 0
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        print(f"error: unknown task(s) {unknown}; choose from {list(TASKS)}", file=sys.stderr)
        return 2
    try:
        result = evaluate(args, tasks)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(results_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def evaluate(args: argparse.Namespace, tasks: list[str]) -> dict:
    from llmserve.config import engine_config_from_args
    from llmserve.evaluate import agreement, datasets, humaneval, perplexity
    from llmserve.evaluate.targets import OfflineTarget, ServerTarget

    if args.base_url:
        target = ServerTarget(args.base_url, args.served_model, args.api_key, args.concurrency)
    else:
        config = engine_config_from_args(args, model=args.model)
        options = {k: v for k, v in {**vars(config.model), **vars(config.cache), **vars(config.scheduler)}.items()
                   if k != "model"}
        target = OfflineTarget.load(args.model, **_changed(options))
    result = {"label": args.label or target.name, "target": target.description, "tasks": {},
              "host": {"machine": platform.machine(), "processor": cpu_model(), "python": platform.python_version()},
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if "perplexity" in tasks:
        tokenizer = target.tokenizer if isinstance(target, OfflineTarget) else _tokenizer(args)
        ids = tokenizer.encode(datasets.perplexity_text(), add_special_tokens=False)[: args.ppl_tokens]
        result["tasks"]["perplexity"] = asdict(perplexity.perplexity(target, ids, args.window, args.stride))
    if "humaneval" in tasks:
        problems = datasets.humaneval_problems()[: args.limit]
        he = humaneval.evaluate(target, problems, args.humaneval_style)
        result["tasks"]["humaneval"] = {"pass_at_1": he.pass_at_1, "passed": he.passed, "problems": he.problems,
                                        "style": args.humaneval_style, "results": [asdict(r) for r in he.results]}
    if "agreement" in tasks:
        prompts = agreement.mtbench_prompts(args.limit or 40)
        if args.reference_url:
            reference = ServerTarget(args.reference_url, None, args.api_key, args.concurrency)
        else:
            reference = OfflineTarget.load(args.model, **_parse_options(args.reference))
        ours = target.complete(prompts, args.agreement_tokens, desc="agreement: target")
        refs = reference.complete(prompts, args.agreement_tokens, desc="agreement: reference")
        result["tasks"]["agreement"] = {**asdict(agreement.agreement(ours, refs)),
                                        "reference": reference.description, "max_tokens": args.agreement_tokens}
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return result


def _changed(options: dict) -> dict:
    """The options that differ from the defaults (what the run description shows)."""
    from llmserve.config import engine_options

    defaults = engine_options()
    return {k: v for k, v in options.items() if v != defaults.get(k)}


def _parse_options(text: str) -> dict:
    """'dtype=float32,quantization=int4' -> options; true/false/none and numbers as such."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--reference {text!r}: use key=value pairs")
        low = value.lower()
        out[key.strip()] = {"true": True, "false": False, "none": None}.get(low, _number(value))
    return out


def _number(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _tokenizer(args: argparse.Namespace):
    if not args.tokenizer:
        raise ValueError("perplexity against a server needs --tokenizer (the served model's tokenizer)")
    from llmserve.loader import load_tokenizer

    return load_tokenizer(args.tokenizer)
