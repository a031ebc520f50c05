"""The command line: every command listed, bad arguments and bad inputs give a one-line reason
and a non-zero exit code."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loraserve.cli import build_parser, main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraserve.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_help_lists_every_command() -> None:
    out = _run("--help")
    assert out.returncode == 0
    for cmd in ("serve", "demo", "export", "catalog", "loadtest"):
        assert cmd in out.stdout


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "abc"], ["serve", "--device", "tpu"], ["serve", "--lora-backend", "cuda"],
    ["nosuchcommand"], ["loadtest"],
])
def test_bad_arguments_exit_2_with_usage(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_serve_with_a_missing_model_dir_fails_with_one_line(tmp_path) -> None:
    out = _run("serve", "--model", str(tmp_path / "missing"), "--port", "0")
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("loraserve serve: error:") and "missing" in lines[-1]


def test_serve_rejects_bad_bounds(tmp_path, demo_dense) -> None:
    out = _run("serve", "--model", str(demo_dense), "--max-batch-size", "0")
    assert out.returncode == 1 and "max_batch_size must be >= 1" in out.stderr


def test_serve_prefix_caching_flag() -> None:
    from loraserve.cli import build_parser
    assert build_parser().parse_args(["serve"]).prefix_caching is True
    assert build_parser().parse_args(["serve", "--no-prefix-caching"]).prefix_caching is False


def test_serve_defaults_are_the_engine_and_server_config_defaults() -> None:
    import dataclasses

    from loraserve.cli import build_parser
    from loraserve.engine.config import EngineConfig
    from loraserve.server.config import ServerConfig
    args = build_parser().parse_args(["serve"])
    for defaults in (EngineConfig(model_dir="m"), ServerConfig()):
        options = [f.name for f in dataclasses.fields(defaults) if f.metadata and hasattr(args, f.name)]
        assert all(getattr(args, name) == getattr(defaults, name) for name in options)
    options = [f.name for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)]
    assert {"max_gpu_adapters", "cpu_cache_mb", "max_batched_tokens", "pinned_adapters", "prefix_caching",
            "torch_threads"} <= set(options)
    assert {"max_request_bytes", "max_seqs_per_request", "shutdown_timeout"} <= set(vars(args))
    assert not {"max_request_bytes", "max_seqs_per_request", "shutdown_timeout"} & \
        {f.name for f in dataclasses.fields(EngineConfig)}  # the HTTP side's, not the engine's
    args = build_parser().parse_args(["serve", "--pin", "t/a", "--pin", "t/b", "--kv-cache-mb", "8"])
    assert args.pinned_adapters == ["t/a", "t/b"] and args.kv_cache_mb == 8


def test_serve_help_shows_each_default() -> None:
    out = " ".join(_run("serve", "--help").stdout.split())  # unwrapped
    assert ("--max-gpu-adapters MAX_GPU_ADAPTERS, --max-loras MAX_GPU_ADAPTERS adapters resident "
            "in the device pool at once (default: 32)") in out  # vLLM's name: an alias
    assert "(default: 512)" in out and "else all cores but one)" in out


# -- every `serve` flag the documents show is one `serve` takes -------------------------------------

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
_FENCE = re.compile(r"^```.*?$(.*?)^```", re.M | re.S)
_SERVE_SPAN = re.compile(r"`((?:\S*/)?(?:loraserve )?serve --[^`]*)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# where the documents list `serve`'s options in prose: the paragraph that starts with the first,
# the table (its header row) of vLLM's names
_LISTS = ("Main `serve` flags:", "| vLLM flag | loraserve option |")


def documented_command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after `serve`) of every `loraserve serve` command line in a code block of
    README.md and docs/*.md, continuation lines joined and comments dropped."""
    out = []
    for doc in DOCS:
        for block in _FENCE.findall(doc.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                if "loraserve serve" in line:
                    words = shlex.split(line, comments=True)
                    out.append((f"{doc.name}: {line.strip()}", words[words.index("serve") + 1:]))
    return out


def documented_serve_flags() -> set[tuple[str, str]]:
    """(flag, document) of every `--flag` the documents show for `serve`: on its command lines,
    in inline `serve --...` spans, and in the lists of its options (_LISTS)."""
    out = {(w.split("=", 1)[0], where.split(":")[0])
           for where, argv in documented_command_lines() for w in argv if w.startswith("--")}
    for doc in DOCS:
        text = doc.read_text()
        for span in _SERVE_SPAN.findall(text):
            out |= {(flag, doc.name) for flag in _FLAG.findall(span)}
        for head in _LISTS:
            if head in text:
                listed = text[text.index(head):].split("\n\n", 1)[0]
                out |= {(flag, doc.name) for flag in _FLAG.findall(listed)}
    return out


def _serve_options() -> set[str]:
    [serve] = [p for name, p in build_parser()._subparsers._group_actions[0].choices.items()
               if name == "serve"]
    return {flag for action in serve._actions for flag in action.option_strings}


def test_every_serve_flag_the_docs_show_is_taken() -> None:
    """...except the vLLM flags the table names as refused (each stops `serve` naming ours:
    tests/test_vllm_flags.py)."""
    from loraserve.cli_vllm import INSTEAD

    shown = documented_serve_flags()
    flags = {flag for flag, _ in shown}
    assert {"--model", "--catalog", "--replicas", "--tool-call-parser", "--torch-threads",
            "--max-loras"} <= flags  # each place was read
    refused = sorted(flags & set(INSTEAD))
    assert refused == ["--quantization"], refused  # the one row of the table saying so
    missing = sorted((flag, doc) for flag, doc in shown
                     if flag not in _serve_options() and flag not in INSTEAD)
    assert not missing, missing


def test_every_documented_serve_command_line_parses() -> None:
    lines = documented_command_lines()
    assert len(lines) >= 8
    for where, argv in lines:
        args = build_parser().parse_args(["serve", *argv])
        assert args.command == "serve", where


def test_serve_train_state_dir() -> None:
    """The directory Tinker training keeps its state in (docs/TRAINING.md)."""
    assert build_parser().parse_args(["serve", "--train-state-dir", "/x"]).train_state_dir == "/x"
    assert build_parser().parse_args(["serve"]).train_state_dir is None
