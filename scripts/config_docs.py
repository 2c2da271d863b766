"""Generate docs/configuration.md from the code that defines the options, so the page cannot drift from it.

    .venv/bin/python scripts/config_docs.py            # write docs/configuration.md
    .venv/bin/python scripts/config_docs.py --check    # exit 1, with a diff, when the page is stale

Where each part comes from:
- engine options: the frozen dataclasses of `llmserve/config.py` (their fields' `help`, `choices`, defaults),
  the flags as `add_engine_arguments` makes them and the keywords as `engine_options()` lists them (the functions
  `llmserve serve` and `LLM(...)` use);
- `llmserve serve` and `llmserve gateway` flags: the parsers their modules build (`add_arguments`), help texts
  expanded by argparse's own formatter, as `--help` prints them;
- per-command engine defaults: the parsers of the other commands that take engine flags;
- the gateway's YAML file: the dataclasses of `llmserve/gateway/config.py` (names, types, defaults) and
  `KEY_NOTES` below for what each key does, since those fields carry no help text; a field without a note, or a
  note without a field, fails the generation.

No model is loaded and torch is not imported: this runs in a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
COMMAND = ".venv/bin/python scripts/config_docs.py"

# What each gateway setting and each speculative_config key does. Their dataclasses carry no help text (only
# source comments), so the words live here; `_check_notes` ties them to the fields both ways.
KEY_NOTES: dict[str, dict[str, str]] = {
    "SpeculativeConfig": {
        "method": "`ngram` (prompt lookup over the request's own tokens) or `draft_model` (a smaller model with the "
                  "same tokenizer)",
        "num_speculative_tokens": "the most proposal tokens a request carries into one step",
        "model": "`draft_model` only (and required there): the draft, a registered name, GGUF file or Hugging Face "
                 "directory",
        "draft_kv_cache_fraction": "`draft_model`: the share of the KV cache budget the draft's own cache takes",
        "prompt_lookup_max": "`ngram`: the longest ending of the sequence looked up",
        "prompt_lookup_min": "`ngram`: the shortest ending looked up",
        "disable_by_batch_size": "no proposals at all while this many requests run (`null`: the cost model alone "
                                 "decides)",
        "adaptive": "`true`: per step, only the proposal tokens that the measured step cost and each request's "
                    "acceptance rate say pay; `false`: every proposal the proposer finds",
        "automatic": "set by the engine when it resolves `auto`, not by users: seeded requests that sample then get "
                     "no proposals",
    },
    "GatewayConfig": {
        "models": "the model names clients send, each with its upstreams (below)",
        "routers": "names that resolve per request to a weak or a strong model (below)",
        "keys": "API keys callers must send; none: the gateway is open (below)",
        "cache": "the response cache (below)",
        "health": "active probes and passive ejection of replicas (below)",
        "retries": "other replicas tried after a failure before the client's first byte",
        "connect_timeout": "seconds to connect to an upstream",
        "read_timeout": "seconds allowed between two bytes of an upstream's answer",
        "max_request_body_bytes": "larger request bodies get 413",
        "prefix_balance_slack": "`prefix_aware`: requests in flight a warm replica may carry above the least "
                                "loaded one before it is passed over",
        "admin_key": "the key `/dashboard`, `/metrics` and `/docs` need once `keys` are set (better: "
                     "`admin_key_env`); none: those pages are closed while keys are set",
        "admin_key_env": "instead of `admin_key`: an environment variable holding it, read at start",
        "open_admin": "`true`: the admin pages open to anyone even while keys are set, on purpose",
    },
    "ModelRoute": {
        "upstreams": "base URLs of the OpenAI-compatible servers (replicas) that serve this model",
        "balancing": "how the replicas share requests: `round_robin`, `least_outstanding` or `prefix_aware`",
        "upstream_model": "the model name sent upstream (`null`: the name clients used)",
        "api_key_env": "an environment variable holding the upstream's key (a hosted API), read at start and sent "
                       "as `Authorization: Bearer`",
        "health_path": "what the prober GETs on each replica; `/v1/models` for a hosted API without `/health`",
        "price": "what its tokens cost: `{input_per_million, output_per_million}` (an API's list price) or "
                 "`{dollars_per_hour, input_tokens_per_second, output_tokens_per_second}` (a machine); none: free",
        "compress": "prompt compression for this model: a mapping of the `compress` keys below; none: only where "
                    "a request asks for it",
        "prefill": "`--role prefill` servers: a chat or completion first computes its prompt on one of them "
                   "(disaggregated prefill/decode; with `decode`, `upstreams` may be empty)",
        "decode": "`--role decode` servers: they pull the prompt's KV from the prefill server and answer; given "
                  "with `prefill`",
    },
    "CompressPolicy": {
        "scorer": "a model of `models:` (a small causal LM) that scores each context token",
        "rate": "keep at most this share of the context's tokens",
        "min_tokens": "a context shorter than this (scorer tokens) is sent as it is",
        "keep_question_words": "keep the question's content words wherever the context has them",
        "context": "what may be compressed: `documents` (the material before the question in the last user "
                   "message), `turns` (earlier user and assistant messages), `system` (system and developer "
                   "prompts: the operator's instructions, only when named)",
    },
    "RouterConfig": {
        "weak": "a model of `models:`, the cheap one",
        "strong": "a model of `models:`, the one hard requests need",
        "router": "`learned`, `judge` or `random`",
        "file": "the router file (`python -m llmserve.gateway.routing.train` writes it): a learned router's "
                "weights, and calibration scores",
        "strong_share": "calibrate the threshold so this share of requests goes to `strong`",
        "threshold": "or give the threshold itself (judge: an expected rating from 1 to 5)",
        "judge_model": "`judge`: the model that rates requests (`null`: `weak`)",
        "seed": "`random`: its generator's seed",
    },
    "APIKey": {
        "key": "the key callers send as `Authorization: Bearer KEY`",
        "key_env": "instead of `key`: an environment variable holding it, read at start",
        "namespace": "the caller's namespace: cached answers never cross namespaces; limits and cost metrics are "
                     "kept per namespace; none: one of its own (keys share only a namespace they name)",
        "requests_per_minute": "requests this key may send in a sliding minute (429 with `Retry-After` past it)",
        "tokens_per_minute": "tokens (prompt + completion) this key may spend in a sliding minute",
    },
    "CacheConfig": {
        "redis_url": "`redis://host:port/db`: a store shared by gateways and kept across restarts; `null`: in this "
                     "process",
        "ttl": "seconds a cached answer lives",
        "exact": "serve identical requests from the cache",
        "semantic": "also serve requests whose last user message means the same (MiniLM embeddings)",
        "semantic_threshold": "the cosine similarity a semantic hit needs",
        "deterministic_only": "cache only requests with `temperature` 0 or a `seed`",
    },
    "HealthConfig": {
        "interval": "seconds between active probes of each replica",
        "timeout": "seconds a probe may take",
        "eject_after": "consecutive failures (connection errors, timeouts, 5xx) that eject a replica",
        "down_after": "consecutive probes without an answer (timeout, refused) that mark a replica not ready; a "
                      "non-200 answer does at once",
        "eject_seconds": "the first ejection; it doubles at each failed trial request, up to 60 s",
    },
}


def generate() -> str:
    """The page, from the code as it is now."""
    from llmserve import config

    _check_notes()
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by scripts/config_docs.py: do not edit by hand. Regenerate with `{COMMAND}`. -->",
        "",
        "This page is generated from the code that defines the options: the engine's config dataclasses",
        "(`llmserve/config.py`), the parsers of `llmserve serve` and `llmserve gateway`, and the gateway's config",
        f"dataclasses (`llmserve/gateway/config.py`). Regenerate it with `{COMMAND}`;",
        "`tests/docs/test_configuration_page.py` fails while it is stale.",
        "",
        "- [Engine options](#engine-options): `llmserve serve` flags and `LLM(...)` keywords",
        "- [Per-command engine defaults](#per-command-engine-defaults)",
        "- [Server options](#server-options): `llmserve serve` only",
        "- [Gateway flags](#gateway-flags): `llmserve gateway`",
        "- [Gateway config file](#gateway-config-file): `llmserve gateway --config FILE.yaml`",
        "",
        "## Engine options",
        "",
        "One option, three spellings: the flag of `llmserve serve` (and of `generate`, `eval`), the keyword of",
        "`LLM(model, **options)`, and the field of `EngineConfig` it lands in. A boolean that is on by default",
        "takes a `--no-...` flag; one whose default is `None` takes both forms, and `None` lets the engine decide.",
        "`llmserve.config.engine_options()` lists every keyword with its default; an unknown keyword is a",
        "`TypeError`, a bad value a `ValueError` naming the option. What the engine makes of them on a given",
        "host is logged at start as the build plan (see [architecture](architecture.md#the-build-plan)).",
        "",
    ]
    flags = _engine_flags()
    options = config.engine_options()
    for section, cls in config._SECTIONS.items():
        out += [f"### `{cls.__name__}` ({section})", "", _first_paragraph(cls), ""]
        out += ["| Flag | Keyword | Type | Default | Description |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            flag = flags.get(f.name)
            help_text = f.metadata["help"].replace("%%", "%")
            if "choices" in f.metadata:
                help_text += "; one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"])
            out.append(_row(" ".join(f"`{s}`" for s in flag) if flag else "—", f"`{f.name}`", f"`{f.type}`",
                            _value(options[f.name]), help_text))
        out.append("")
    spec = config.SpeculativeConfig
    out += [
        "### Speculative decoding (`speculative_config`)",
        "",
        f"Flag `{' '.join(flags['speculative_config'])} JSON`, keyword `speculative_config` (a dict, a JSON string,",
        f"`\"auto\"`, `\"off\"` or `None`), default `{options['speculative_config']}`. The flag's help:",
        "",
        "> " + config.SPECULATIVE_HELP,
        "",
        "The JSON object's keys (vLLM's names; an unknown key is refused at start):",
        "",
        "| Key | Type | Default | Description |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(spec):
        out.append(_row(f"`{f.name}`", f"`{_file_type(f.type)}`", _value(f.default, "json"),
                        KEY_NOTES["SpeculativeConfig"][f.name]))
    out += ["", "See [speculative decoding](speculative-decoding.md) for what `auto` does.", ""]

    out += _per_command_defaults(options)
    out += ["## Server options", "",
            "`llmserve serve`'s own flags, beside the engine options above.", ""]
    out += _parser_tables(_parser("serve"), skip_titles=("engine",))
    out += ["## Gateway flags", "",
            "`llmserve gateway`'s flags. Flags given beside `--config` override the file's values; see",
            "[gateway](gateway.md).", ""]
    out += _parser_tables(_parser("gateway"))
    out += _gateway_file()
    return "\n".join(out).rstrip() + "\n"


# --- engine ------------------------------------------------------------------------------------------------------


def _engine_flags() -> dict[str, list[str]]:
    """Each engine option's flags, as `add_engine_arguments` (what `llmserve serve` calls) makes them."""
    from llmserve.config import add_engine_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    flags: dict[str, list[str]] = {}
    for action in parser._actions:
        flags.setdefault(action.dest, []).extend(action.option_strings)
    return flags


def _per_command_defaults(options: dict[str, Any]) -> list[str]:
    """Where a command that takes the engine flags (`add_engine_arguments`) gives them other defaults than
    `LLM(...)`'s, or leaves one out."""
    from llmserve.cli import SUBCOMMANDS

    rows = []
    for name in SUBCOMMANDS:
        actions = _engine_actions(_parser(name))
        if "speculative_config" not in actions:  # not a command of the engine flags (its own --seed, say)
            continue
        for dest in options:
            if dest not in actions:
                if dest in _engine_flags():
                    rows.append(_row(f"`llmserve {name}`", f"`{dest}`", "not taken", _value(options[dest])))
            elif actions[dest] != options[dest]:
                rows.append(_row(f"`llmserve {name}`", f"`{dest}`", _value(actions[dest]), _value(options[dest])))
    out = ["## Per-command engine defaults", "",
           "`llmserve serve`, `llmserve generate` and `llmserve eval` take the engine flags. Where a command's",
           "defaults differ from those above (`LLM(...)`'s):", ""]
    if rows:
        out += ["| Command | Option | The command's default | `LLM(...)`'s default |", "|---|---|---|---|", *rows]
    else:
        out.append("Nowhere: every command uses the defaults above.")
    return out + [""]


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """dest -> default of the engine options among a parser's actions."""
    from llmserve.config import engine_options

    names = engine_options()
    return {a.dest: a.default for a in parser._actions if a.dest in names and a.option_strings}


# --- command-line parsers ----------------------------------------------------------------------------------------


def _parser(command: str) -> argparse.ArgumentParser:
    """The parser of `llmserve COMMAND`, built by the module `llmserve.cli` runs for it."""
    from llmserve.cli import SUBCOMMANDS

    module_name, description = SUBCOMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"llmserve {command}", description=description)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def _parser_tables(parser: argparse.ArgumentParser, skip_titles: tuple[str, ...] = ()) -> list[str]:
    """One table per argument group, help as `--help` prints it (argparse's own expansion of %(default)s)."""
    formatter = parser._get_formatter()
    out: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)
                   and not isinstance(a, argparse._SubParsersAction)]
        if not actions or group.title.startswith(skip_titles):
            continue
        title = {"positional arguments": "Arguments", "options": "General"}.get(group.title, group.title)
        out += [f"### {title[0].upper()}{title[1:]}", "", "| Flag | Value | Default | Description |",
                "|---|---|---|---|"]
        for action in actions:
            names = " ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
            out.append(_row(names, _metavar(action), _flag_default(action),
                            formatter._expand_help(action) if action.help else ""))
        out.append("")
    return out


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "—"
    if action.choices:
        return ", ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    text = f"`{metavar}`"
    if action.nargs == "+":
        text += " (one or more)"
    elif action.nargs in ("*", "?"):
        text += " (optional)"
    if isinstance(action, argparse._AppendAction):
        text += " (repeatable)"
    return text


def _flag_default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._AppendAction) and action.default == []:
        return "—"
    return _value(action.default)


# --- gateway config file -----------------------------------------------------------------------------------------


def _gateway_file() -> list[str]:
    from llmserve.gateway import config as gw
    from llmserve.gateway.compression.policy import CompressPolicy
    from llmserve.gateway.pricing import Price
    from llmserve.gateway.routing.router import RouterConfig

    first = (gw.__doc__ or "").split("```yaml", 1)
    example = first[1].split("```", 1)[0].strip("\n") if len(first) == 2 else ""
    out = ["## Gateway config file", "",
           "A YAML file of these sections (`llmserve/gateway/config.py`). An unknown key anywhere is refused at",
           "start with its place named. The example in the module's docstring:", "",
           "```yaml", example, "```", "",
           "### Top level", "", *_key_table(gw.GatewayConfig, sections=("cache", "health"),
                                            extra={"admin_key_env": ("str | None", None)}),
           "### `models.NAME`", "",
           "`NAME` is the model name clients send. `upstreams` may be one URL or a list.", "",
           *_key_table(gw.ModelRoute, skip=("name", "api_key"), extra={"api_key_env": ("str | None", None)},
                       order=("upstreams", "balancing", "upstream_model", "api_key_env")),
           "#### `models.NAME.price`", "",
           "Either an API's list price:", "",
           *_price_table(Price), "",
           "or a machine's, turned into the same two prices by its measured throughputs:", "",
           *_self_hosted_table(Price), "",
           "#### `models.NAME.compress`", "",
           "Also the shape of a request body's `compress` field (`false`, `true`, or a mapping of these keys over",
           "the model's policy).", "",
           *_key_table(CompressPolicy),
           "### `routers.NAME`", "",
           "`NAME` is a name clients send; it must not be a model's.", "",
           *_key_table(RouterConfig, skip=("name",), notes="RouterConfig"),
           "### `keys`", "",
           "A list; each entry needs `key` or `key_env`.", "",
           *_key_table(gw.APIKey, extra={"key_env": ("str | None", None)}, notes="APIKey"),
           "### `cache`", "", *_key_table(gw.CacheConfig),
           "### `health`", "", *_key_table(gw.HealthConfig)]
    return out


_GATEWAY_EXTRA_NOTES = {"api_key_env": "ModelRoute", "key_env": "APIKey", "admin_key_env": "GatewayConfig"}


def _key_table(cls: type, skip: tuple[str, ...] = (), extra: dict[str, tuple[str, Any]] | None = None,
               order: tuple[str, ...] = (), notes: str | None = None, sections: tuple[str, ...] = ()) -> list[str]:
    notes = notes or cls.__name__
    rows: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in sections:
            default = f"see `{f.name}` below"
        elif f.default is not dataclasses.MISSING:
            default = _value(f.default, "yaml")
        elif f.default_factory is not dataclasses.MISSING:
            default = _value(f.default_factory(), "yaml")
        else:
            default = "required"
        rows[f.name] = (f"`{_file_type(f.type)}`", default)
    for name, (type_name, default) in (extra or {}).items():
        rows[name] = (f"`{_file_type(type_name)}`", _value(default, "yaml"))
    names = [n for n in order if n in rows] + [n for n in rows if n not in order]
    out = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for name in names:
        if name == "key":
            out.append(_row("`key`", "`str`", "required (or `key_env`)", KEY_NOTES[notes][name]))
            continue
        out.append(_row(f"`{name}`", *rows[name], KEY_NOTES[notes][name]))
    return out + [""]


def _price_table(price: type) -> list[str]:
    out = ["| Key | Type | Default |", "|---|---|---|"]
    for f in dataclasses.fields(price):
        out.append(_row(f"`{f.name}`", f"`{f.type}`", _value(f.default, "yaml")))
    return out


def _self_hosted_table(price: type) -> list[str]:
    out = ["| Key | Type | Default |", "|---|---|---|"]
    for name, p in inspect.signature(price.self_hosted).parameters.items():
        out.append(_row(f"`{name}`", f"`{p.annotation}`", "required"))
    return out


def _check_notes() -> None:
    """Every documented field has a note and every note a field: a new or renamed setting fails the generation."""
    from llmserve import config
    from llmserve.gateway import config as gw
    from llmserve.gateway.compression.policy import CompressPolicy
    from llmserve.gateway.routing.router import RouterConfig

    skipped = {"ModelRoute": {"name", "api_key"}, "RouterConfig": {"name"}}
    classes = {"SpeculativeConfig": config.SpeculativeConfig, "GatewayConfig": gw.GatewayConfig,
               "ModelRoute": gw.ModelRoute, "CompressPolicy": CompressPolicy, "RouterConfig": RouterConfig,
               "APIKey": gw.APIKey, "CacheConfig": gw.CacheConfig, "HealthConfig": gw.HealthConfig}
    problems = []
    for name, cls in classes.items():
        fields = {f.name for f in dataclasses.fields(cls)} - skipped.get(name, set())
        fields |= {key for key, owner in _GATEWAY_EXTRA_NOTES.items() if owner == name}
        notes = set(KEY_NOTES[name])
        problems += [f"{name}.{field}: no entry in KEY_NOTES" for field in sorted(fields - notes)]
        problems += [f"KEY_NOTES[{name!r}][{note!r}]: no such field" for note in sorted(notes - fields)]
    if problems:
        raise SystemExit("scripts/config_docs.py: describe the new settings in KEY_NOTES:\n  " + "\n  ".join(problems))


# --- formatting --------------------------------------------------------------------------------------------------


def _first_paragraph(cls: type) -> str:
    return " ".join(inspect.getdoc(cls).split("\n\n")[0].split())


def _value(value: Any, style: str = "python") -> str:
    """A default as the reader writes it: Python's spelling for flags and keywords, YAML's / JSON's for files."""
    if style != "python" and (value is None or isinstance(value, bool)):
        return f"`{_SPELLING[style][value]}`"
    if value is None:
        return "`None`"
    if isinstance(value, bool):
        return f"`{value}`"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ", ".join(f"{f.name}: {_value(getattr(value, f.name), style).strip('`')}"
                          for f in dataclasses.fields(value))
        return f"`{{{items}}}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, list | tuple | dict) and not value:
        return "none"
    return f"`{value}`"


_SPELLING = {"yaml": {None: "null", True: "true", False: "false"}, "json": {None: "null", True: "true", False: "false"}}


def _file_type(annotation: str) -> str:
    """A field's annotation as a file's reader sees it: lists, not tuples; null, not None."""
    return annotation.replace("tuple[", "list[").replace(", ...]", "]").replace("None", "null")


def _row(*cells: str) -> str:
    return "| " + " | ".join(" ".join(c.replace("|", "\\|").split()) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/configuration.md from the option definitions.")
    parser.add_argument("--check", action="store_true", help="exit 1, printing the difference, if the page is stale")
    args = parser.parse_args(argv)
    page = generate()
    if not args.check:
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(ROOT)}")
        return 0
    current = PAGE.read_text() if PAGE.exists() else ""
    if current == page:
        return 0
    diff = difflib.unified_diff(current.splitlines(keepends=True), page.splitlines(keepends=True),
                                "docs/configuration.md (committed)", "docs/configuration.md (generated)")
    sys.stdout.writelines(diff)
    print(f"\ndocs/configuration.md is stale: run `{COMMAND}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
