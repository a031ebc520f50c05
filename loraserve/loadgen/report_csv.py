"""series.csv of `loraserve loadtest --report DIR`: every point of every series of summary.json,
one row each, for a spreadsheet or pandas (`pd.read_csv("series.csv")`).

Columns: `series` (summary.json's key), `label` (the line within it: a tier, a source, an error
kind, "ok_per_s"), `x` and `y`:

  throughput          label ok_per_s | errors_per_s | output_tokens_per_s; x seconds into the
                      run (bin middle), y per second
  latency_cdf         label e2e_s | ttft_s | ttft_cold_s | ttft_hot_s | itl_s; x seconds, y the
                      fraction of requests at most x
  errors_by_status    label the kind; x empty, y requests
  every other series  label its group; x seconds into the run, y the value (empty where the
                      series has none, e.g. a hit rate of an interval with no lookups)
"""
from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

COLUMNS = ("series", "label", "x", "y")
_THROUGHPUT = ("ok_per_s", "errors_per_s", "output_tokens_per_s")

Row = tuple[str, str, float | str, float | str]


def series_rows(series: dict) -> Iterator[Row]:
    """(series, label, x, y) for every point of `series` (report.build_series' dict)."""
    for key, value in series.items():
        if key == "throughput":
            for label in _THROUGHPUT:
                yield from _points(key, label, value["t"], value.get(label, []))
        elif key == "latency_cdf":
            for label, c in value.items():
                yield from _points(key, label, c["x"], c["p"])
        elif key == "errors_by_status":
            for label, count in value.items():
                yield key, label, "", count
        else:
            for label, g in value.items():
                yield from _points(key, label, g["t"], g["value"])


def _points(key: str, label: str, xs: list, ys: list) -> Iterator[Row]:
    for x, y in zip(xs, ys):
        yield key, label, x, "" if y is None else y


def write_series_csv(path: str | Path, series: dict) -> int:
    """Write series.csv (header, then `series_rows`); returns the number of rows."""
    n = 0
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for row in series_rows(series):
            w.writerow(row)
            n += 1
    return n
