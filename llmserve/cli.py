"""`llmserve` command line: one entry point, one sub-command per job.

Each sub-command lives beside the code it drives and is imported lazily, so `llmserve bench`
never pays for importing torch and `llmserve --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("llmserve.server.cli", "Serve a model over an OpenAI-compatible HTTP API."),
    "generate": ("llmserve.entrypoints.generate_cli", "Generate text offline and print it as it streams."),
    "bench": ("llmserve.bench.cli", "Load-test any OpenAI-compatible server (TTFT, ITL, throughput)."),
    "gateway": ("llmserve.gateway.cli", "One OpenAI endpoint in front of many servers: balancing, failover, caches."),
    "eval": ("llmserve.evaluate.cli", "Measure quality: perplexity, HumanEval pass@1, agreement with a reference."),
    "plan": ("llmserve.plan.cli", "Capacity and cost: memory fit, replicas within an SLO, break-even against APIs."),
    "quantize": ("llmserve.entrypoints.quantize_cli", "Write a quantized checkpoint (AWQ, int4, int8) to serve later."),
    "download": ("llmserve.entrypoints.download_cli", "Install a registered model into the cache, checked."),
    "models": ("llmserve.entrypoints.models_cli", "List the registered models and where they are installed."),
}


# What a sub-command needs beyond the engine comes as a pip extra (pyproject.toml); a user who only serves
# installs none of them. A module missing from an extra is reported with the line that installs it.
EXTRAS: dict[str, str] = {"gateway": "gateway", "bench": "bench", "plan": "bench", "eval": "eval"}
EXTRA_MODULES: dict[str, str] = {"yaml": "gateway", "redis": "gateway", "hnswlib": "gateway", "aiohttp": "bench",
                                 "httpx": "eval", "matplotlib": "bench", "ray": "ray"}


def missing_extra(command: str, error: ModuleNotFoundError) -> str | None:
    """The message for a module of an optional extra that is not installed, or None for any other missing module."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRA_MODULES:
        return None
    extra = EXTRAS.get(command, EXTRA_MODULES[module])
    return (f"llmserve {command} needs the Python package '{module}', which is not installed: "
            f"pip install 'llmserve[{extra}]'")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen sub-command's module is imported
            importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in SUBCOMMANDS), "")
    try:
        args = build_parser(argv).parse_args(argv)
        module = importlib.import_module(SUBCOMMANDS[args.command][0])
        return int(module.run(args) or 0)
    except ModuleNotFoundError as error:
        message = missing_extra(command, error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
