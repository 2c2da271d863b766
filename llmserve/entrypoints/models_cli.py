"""`llmserve models`: the registered models, and which are installed where."""

from __future__ import annotations

import argparse

from llmserve.loader.default_models import EMBEDDED_MODELS, PARTED_MODELS, installed_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    rows = [("name", "installed", "what")]
    for entry in [*EMBEDDED_MODELS.values(), *PARTED_MODELS.values()]:
        path = installed_path(entry)
        rows.append((entry.name, path or "no (llmserve download " + entry.name + ")", entry.description))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    for name, where, what in rows:
        print(f"{name:<{widths[0]}}  {where:<{widths[1]}}  {what}")
    return 0
