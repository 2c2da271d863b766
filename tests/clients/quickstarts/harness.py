"""What every client library's quick-start shares: the question, the tool, the output type, and the report.

A quick-start script runs inside its library's own virtualenv (stdlib and pydantic only here, which each of those
has) and prints one JSON line per step: `ok`, `model` (the 0.5B model's own choice made the library give up:
it called the tool again, or never answered in text) or `server` (anything else: an HTTP error, a malformed
answer, a library that could not parse what came back).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata

from pydantic import BaseModel

QUESTION = "Name three colors."
STRUCTURED = "Tell me about the city of Paris."
TOOL_QUESTION = "What is the weather in Paris?"
MAX_TOKENS = 48


class City(BaseModel):
    name: str
    country: str


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny, 21 C in {city}"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ModelChoice(Exception):
    """The model's own choice, not a server defect (a check that needs the model to behave well)."""


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True, help="the OpenAI-compatible base URL, ending in /v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default="none")
    return parser.parse_args()


def run(library: str, steps: dict[str, Callable[[], str]], model_choices: tuple[type[BaseException], ...] = ()) -> int:
    """Run each step, printing its outcome; the exit status counts the server defects."""
    version = metadata.version(library)
    defects = 0
    for name, step in steps.items():
        began = time.perf_counter()
        try:
            outcome, detail = "ok", step()
        except ModelChoice as e:
            outcome, detail = "model", str(e)
        except model_choices as e:
            outcome, detail = "model", f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - every other failure is reported as the server's
            outcome, detail = "server", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
            defects += 1
        print(json.dumps({"library": library, "version": version, "step": name, "outcome": outcome,
                          "detail": str(detail)[:2000], "seconds": round(time.perf_counter() - began, 2)}),
              flush=True)
    return defects


def check(condition: bool, why: str) -> None:
    """A server-side promise (a constraint, a forced tool call): its failure is a defect."""
    if not condition:
        raise AssertionError(why)


def expect_model(condition: bool, why: str) -> None:
    """What only a well-behaved model does: its failure is the model's choice."""
    if not condition:
        raise ModelChoice(why)


def finish(code: int) -> None:
    sys.exit(min(code, 100))
