"""`loraserve loadtest`: the command's public names, kept here for their callers; the code lives
in `loraserve.loadgen` (what each module holds: its package doc). The command's help is
`loraserve.loadgen.cli`'s doc."""
from __future__ import annotations

from loraserve.loadgen.cli import _main, add_subcommand, list_catalog_adapters, read_adapter_file
from loraserve.loadgen.config import CLIENTS, LoadTestConfig
from loraserve.loadgen.run import HIT_METRIC, MISS_METRIC, WORDS, run_loadtest
from loraserve.loadgen.sample import Sample
from loraserve.loadgen.summary import format_report, summarize, summarize_wrk

__all__ = ["CLIENTS", "HIT_METRIC", "MISS_METRIC", "WORDS", "LoadTestConfig", "Sample", "add_subcommand",
           "format_report", "list_catalog_adapters", "read_adapter_file", "run_loadtest", "summarize",
           "summarize_wrk"]
