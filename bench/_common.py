"""Helpers the benchmark scripts share."""
from __future__ import annotations

from pathlib import Path


def base_or_demo(model: str | None) -> str:
    """`--model` when given, else the demo base (built under .loraserve/demo on first use)."""
    if model is not None:
        return model
    from loraserve.demo import build_demo
    return str(build_demo(Path(".loraserve/demo")).qwen3)
