"""The command line: every command listed, bad arguments and bad inputs give a one-line reason
and a non-zero exit code."""
from __future__ import annotations

import subprocess
import sys

import pytest

from loraserve.cli import main


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
