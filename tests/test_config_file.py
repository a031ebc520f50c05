"""`serve --config FILE` and `LORASERVE_<FLAG>`: every serve flag settable from a TOML file or
the environment (the table is the parser's own), flags over the environment over the file, and
a key that is no flag refused by name."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loraserve.cli import build_parser
from loraserve.cli_config import options, reparse


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _parse(tmp_path: Path, toml: str | None, *argv: str, env: dict | None = None):
    args = ["serve", *argv]
    if toml is not None:
        (tmp_path / "serve.toml").write_text(toml)
        args += ["--config", str(tmp_path / "serve.toml")]
    parser = build_parser()
    return reparse(parser, args, "serve", environ=env or {})


FILE = """
model = "/models/qwen3"
port = 9001
max-batch-size = 12
max_waiting = 7            # '_' may stand for '-'
pin = ["acme/a", "acme/b"]
no-prefix-caching = true
dtype = "float32"
shutdown-timeout = 45.5
"""


def test_the_file_sets_flags_of_every_kind(tmp_path: Path) -> None:
    args = _parse(tmp_path, FILE)
    assert (args.model, args.port, args.max_batch_size, args.max_waiting) == \
        ("/models/qwen3", 9001, 12, 7)
    assert args.pinned_adapters == ["acme/a", "acme/b"] and args.prefix_caching is False
    assert (args.dtype, args.shutdown_timeout) == ("float32", 45.5)


def test_flags_override_the_environment_which_overrides_the_file(tmp_path: Path) -> None:
    env = {"LORASERVE_PORT": "9002", "LORASERVE_PIN": "env/x, env/y",
           "LORASERVE_MAX_BATCH_SIZE": "5", "LORASERVE_SINGLE_PROCESS": "yes",
           "LORASERVE_CATALOG_HOSTS": "0"}  # a variable that is no flag: not ours, ignored
    args = _parse(tmp_path, FILE, "--port", "9003", env=env)
    assert args.port == 9003 and args.max_batch_size == 5 and args.single_process is True
    assert args.pinned_adapters == ["env/x", "env/y"]  # a list is replaced, not extended
    args = _parse(tmp_path, FILE, "--pin", "flag/z", env=env)
    assert args.pinned_adapters == ["flag/z"] and args.model == "/models/qwen3"
    assert _parse(tmp_path, None, env={"LORASERVE_HOST": "0.0.0.0"}).host == "0.0.0.0"


@pytest.mark.parametrize("toml, needle", [
    ("port = 1\nmax-batch = 3\nzeta = 1\n", "unknown keys max-batch, zeta"),
    ("[server]\nport = 1\n", "unknown key server"),
    ("port = true\n", "port takes a string or a number"),
    ("single-process = 1\n", "single-process is a switch: true or false"),
    ("port = \"x\"\n", "argument --port: invalid int value"),
    ("port = [1\n", "malformed TOML"),
])
def test_a_bad_file_stops_serve_naming_the_key(tmp_path: Path, capsys, toml: str,
                                               needle: str) -> None:
    with pytest.raises(SystemExit) as stop:
        _parse(tmp_path, toml)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "loraserve serve: error:" in err and needle in err, err


def test_every_flag_is_a_key_and_takes_its_default_back(tmp_path: Path) -> None:
    serve = _serve_parser(build_parser())
    table = options(serve)
    flags = {f[2:] for a in serve._actions for f in a.option_strings if f.startswith("--")}
    assert set(table) == flags - {"help", "config"}
    plain = vars(_parse(tmp_path, None))
    lines = []
    for name, action in table.items():
        default = action.default
        if action.nargs == 0 or default is None or default == [] or action.dest == "pinned_adapters":
            continue
        if isinstance(default, list):
            lines.append(f"{name} = {default!r}")
        elif isinstance(default, str):
            lines.append(f"{name} = {default!r}".replace("'", '"'))
        elif not isinstance(default, bool):
            lines.append(f"{name} = {default!r}")
    assert len(lines) > 30
    got = vars(_parse(tmp_path, "\n".join(lines) + "\n"))
    got.pop("config")
    plain.pop("config")
    assert got == plain
