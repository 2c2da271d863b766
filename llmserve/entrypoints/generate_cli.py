"""`llmserve generate "prompt"`: one prompt through the offline engine, text printed as it streams."""

from __future__ import annotations

import argparse
import logging
import sys

from llmserve.config import add_engine_arguments, engine_config_from_args
from llmserve.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text (a user message with --chat)")
    parser.add_argument("--model", default=None, help="registered name, GGUF file or HF directory "
                        "(default: the embedded smollm2-135m)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", dest="request_seed", type=int, default=None,
                        help="the request's sampling seed (the same text for the same seed)")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    # one prompt: a short context, a small cache, one sequence
    # (--seed above is the request's own; the engine keeps its default)
    add_engine_arguments(parser.add_argument_group("engine"),
                         defaults={"max_model_len": 4096, "kv_cache_memory_gb": 0.5, "max_num_seqs": 1},
                         skip=("seed",))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from llmserve.engine.llm_engine import LLMEngine

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.request_seed,
            max_tokens=args.max_tokens, stop=args.stop,
        )
        engine = LLMEngine(engine_config_from_args(args, model=args.model))
        prompt: str | list[int] = args.prompt
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            prompt = engine.processor.encode_chat(messages)
        engine.add_request("cli", prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas: the text each step added
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
            finish = out.outputs[0].finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason={finish}]", file=sys.stderr)
    return 0
