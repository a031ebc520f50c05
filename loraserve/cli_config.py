"""`serve --config FILE` and `LORASERVE_*`: every `serve` flag from a TOML file or the
environment, read off the argparse parser itself, so one table of options (the flags) drives
all three.

    # serve.toml: keys are flag names without the dashes (`_` may stand for `-`)
    model = "/models/qwen3"
    port = 8000
    max-batch-size = 32
    pin = ["acme/support", "beta/chat"]   # a repeatable flag takes a list
    no-prefix-caching = true              # a switch takes true (passed) or false (not passed)

The environment variable of a flag is `LORASERVE_` and its name in capitals, `-` as `_`
(`LORASERVE_MAX_BATCH_SIZE=32`, `LORASERVE_PIN=acme/support,beta/chat`, a switch: 1/0,
true/false, yes/no, on/off). Precedence: flags, then the environment, then the file, then the
defaults. The settings become flags before the command line's own (argparse checks them as it
checks flags; a later flag wins; a repeatable flag given later replaces the earlier source's
list). A key the file has that is no flag, a table or a wrong kind of value stops `serve` with
an error naming it.
"""
from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "LORASERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_NOT_SETTABLE = {"help", "config"}


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """`{name: action}` of every settable long flag (`--max-batch-size` -> `max-batch-size`)."""
    out = {}
    for action in parser._actions:
        for flag in action.option_strings:
            name = flag[2:]
            if flag.startswith("--") and action.dest not in _NOT_SETTABLE and name not in _NOT_SETTABLE:
                out[name] = action
    return out


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction)


def _tokens(name: str, action: argparse.Action, value: Any, origin: str) -> list[str]:
    """The flags that set `name` to `value` (a TOML value, or a list for a repeatable flag)."""
    flag = f"--{name}"
    if _is_switch(action):
        if not isinstance(value, bool):
            raise ValueError(f"{origin}: {name} is a switch: true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction) and not name.startswith("no-"):
            return [flag if value else f"--no-{name}"]
        return [flag] if value else []
    # `--flag=value`: one token each, so that a flag taking several values (`--lora-modules`)
    # never takes the command line's positional MODEL after it
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        return [f"{flag}={_scalar(name, item, origin)}" for item in values]
    return [f"{flag}={_scalar(name, value, origin)}"]


def _scalar(name: str, value: Any, origin: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{origin}: {name} takes a string or a number, got {value!r}")
    return str(value)


def file_settings(path: str, table: Mapping[str, argparse.Action]) -> list[tuple[str, list[str]]]:
    """[(flag name, flags)] of a config file; ValueError naming unknown keys or bad values."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"config file {path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path}: malformed TOML: {exc}") from None
    names = {key: key.replace("_", "-") for key in doc}
    unknown = sorted(key for key, name in names.items() if name not in table)
    if unknown:
        raise ValueError(f"config file {path}: unknown key{'s' * (len(unknown) > 1)} "
                         f"{', '.join(unknown)} (the keys are `serve`'s flag names, e.g. "
                         "max-batch-size; see `loraserve serve --help`)")
    return [(name, _tokens(name, table[name], doc[key], f"config file {path}"))
            for key, name in names.items()]


def env_settings(environ: Mapping[str, str],
                 table: Mapping[str, argparse.Action]) -> list[tuple[str, list[str]]]:
    """[(flag name, flags)] of the `LORASERVE_<FLAG>` variables set (other variables ignored)."""
    out = []
    for name, action in table.items():
        var = ENV_PREFIX + name.upper().replace("-", "_")
        text = environ.get(var)
        if text is None:
            continue
        value: Any = text
        if _is_switch(action):
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(f"${var}: a switch: 1/0, true/false, yes/no or on/off, got {text!r}")
            value = text.lower() in _TRUE
        elif isinstance(action, argparse._AppendAction):
            value = [item.strip() for item in text.split(",") if item.strip()]
        out.append((name, _tokens(name, action, value, f"${var}")))
    return out


def _given(argv: list[str], action: argparse.Action) -> bool:
    return any(t == f or t.startswith(f + "=") for t in argv for f in action.option_strings)


def settings_argv(parser: argparse.ArgumentParser, argv: list[str], config: str | None,
                  environ: Mapping[str, str]) -> list[str]:
    """`argv` (a subcommand's own arguments) with the file's and the environment's settings put
    before it as flags; a repeatable flag keeps the latest source's list only."""
    table = options(parser)
    sources = [file_settings(config, table) if config else [], env_settings(environ, table)]
    out: list[str] = []
    for n, source in enumerate(sources):
        later = [t for s in sources[n + 1:] for _, tokens in s for t in tokens] + argv
        for name, tokens in source:
            action = table[name]
            if isinstance(action, argparse._AppendAction) and _given(later, action):
                continue
            out += tokens
    return out + argv


def reparse(parser: argparse.ArgumentParser, argv: list[str], command: str,
            environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The main parser's parse of `argv` with `command`'s config file and environment applied
    (errors go through the subcommand's parser: usage, one line, exit 2)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    subparser = sub.choices[command]
    at = argv.index(command)
    config = subparser.parse_known_args(argv[at + 1:])[0].config
    try:
        own = settings_argv(subparser, argv[at + 1:], config,
                            os.environ if environ is None else environ)
    except ValueError as exc:
        subparser.error(str(exc))
    return parser.parse_args([*argv[:at + 1], *own])
