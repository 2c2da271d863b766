"""instructor's quick-start in its default mode (TOOLS: the output type as a forced function call): a
structured answer, a partial stream of one, a list of them, and the patched client's plain chat."""

from __future__ import annotations

from collections.abc import Iterable

import instructor
import openai
from harness import MAX_TOKENS, QUESTION, STRUCTURED, City, arguments, check, finish, run

args = arguments()
base = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
client = instructor.from_openai(base)  # mode=instructor.Mode.TOOLS, the default
check(client.mode == instructor.Mode.TOOLS, f"the default mode is {client.mode}")
common = {"model": args.model, "temperature": 0, "max_tokens": 64, "max_retries": 0}


def chat() -> str:
    answer = client.chat.completions.create(response_model=None, messages=[{"role": "user", "content": QUESTION}],
                                            model=args.model, temperature=0, max_tokens=MAX_TOKENS)
    check(bool(answer.choices[0].message.content), "empty answer")
    return answer.choices[0].message.content


def structured() -> str:
    city = client.chat.completions.create(response_model=City, messages=[{"role": "user", "content": STRUCTURED}],
                                          **common)
    check(isinstance(city, City) and bool(city.name), f"not a City: {city!r}")
    return city.model_dump_json()


def stream() -> str:
    partials = list(client.chat.completions.create_partial(
        response_model=City, messages=[{"role": "user", "content": STRUCTURED}], **common))
    check(len(partials) > 1, f"{len(partials)} partial(s): not streamed")
    whole = client.chat.completions.create(response_model=City, messages=[{"role": "user", "content": STRUCTURED}],
                                           **common)
    check(partials[-1].model_dump() == whole.model_dump(), f"the stream ended in {partials[-1]!r}, not {whole!r}")
    return f"{len(partials)} partials, last {partials[-1].model_dump_json()}"


def tool() -> str:
    """A list of the output type: instructor's parallel form, each item one call."""
    cities = client.chat.completions.create(
        response_model=Iterable[City], messages=[{"role": "user", "content": "Name two cities in Italy."}], **common)
    cities = list(cities)
    check(len(cities) >= 1 and all(isinstance(c, City) for c in cities), f"not cities: {cities!r}")
    return ", ".join(c.name for c in cities)


finish(run("instructor", {"chat": chat, "stream": stream, "structured": structured, "tool": tool}))
