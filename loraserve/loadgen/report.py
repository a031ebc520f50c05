"""`loraserve loadtest --report DIR`: report.html (charts people can look at), summary.json, each
chart again as a PNG (for a ticket or a slide: throughput.png, latency.png, hit_rate.png,
page_ins.png, resident_adapters.png, memory.png, errors.png) and series.csv (every series' points,
one row each: `report_csv.py`).

The series (summary.json's "series", every key always present, empty when the run had nothing
to show):

  throughput         per time bin: ok and failed requests/s, output tokens/s (from the client's
                     own samples; with wrk, from the server's loraserve_requests_total)
  latency_cdf        end-to-end and TTFT distributions: x (seconds) against p
  errors_by_status   failed requests by kind ("http 429", "ResponseTimeout", ...)
  errors_over_time   failed requests/s per kind, per time bin
  hit_rate           per adapter tier: hits / lookups in each scrape interval
  page_ins_per_s     per source tier: adapters paged in per second
  evictions_per_s    per tier: adapters evicted per second
  resident_adapters  per tier: adapters resident (gauge)
  resident_bytes     per tier: bytes of resident adapters (gauge)
  memory_bytes       resident memory of the API server and of the engine core (gauges), each
                     apart as "anonymous" (its own memory) and "file-backed" (mapped files:
                     the catalog's LMDB pages, reclaimable page cache) when the server says so

The charts are matplotlib figures written as inline SVG (text kept as text), so the page needs
nothing but itself: no scripts, no stylesheets or fonts from elsewhere; the same figures are
saved as the PNGs.
"""
from __future__ import annotations

import html
import io
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loraserve.loadgen.report_csv import write_series_csv

SERIES_KEYS = ("throughput", "latency_cdf", "errors_by_status", "errors_over_time", "hit_rate",
               "page_ins_per_s", "evictions_per_s", "resident_adapters", "resident_bytes",
               "memory_bytes")
CDF_POINTS = 400

_LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _split_key(key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = key.partition("{")
    return name, dict(_LABELS.findall(rest))


def cdf(values: Sequence[float], points: int = CDF_POINTS) -> dict[str, list[float]]:
    """The empirical CDF of `values`, at most `points` (x, p) pairs."""
    if not len(values):
        return {"x": [], "p": []}
    xs = np.sort(np.asarray(values, dtype=float))
    if len(xs) <= points:
        return {"x": xs.tolist(), "p": (np.arange(1, len(xs) + 1) / len(xs)).tolist()}
    p = np.linspace(0.0, 1.0, points)
    return {"x": np.quantile(xs, p).tolist(), "p": p.tolist()}


def _bins(wall: float, bin_s: float) -> int:
    return max(1, int(np.ceil(wall / bin_s - 1e-9)))


def client_throughput(samples: Sequence[Any], wall: float, bin_s: float) -> tuple[dict, dict]:
    """(throughput, errors_over_time) from per-request samples (`start`, `e2e`, `ok`, ...)."""
    n = _bins(wall, bin_s)
    ok, bad, tokens = np.zeros(n), np.zeros(n), np.zeros(n)
    per_kind: dict[str, np.ndarray] = {}
    for s in samples:
        i = min(int((s.start + s.e2e) / bin_s), n - 1)
        if s.ok:
            ok[i] += 1
            tokens[i] += s.output_tokens
        else:
            bad[i] += 1
            per_kind.setdefault(s.error or "error", np.zeros(n))[i] += 1
    t = ((np.arange(n) + 0.5) * bin_s).tolist()
    throughput = {"source": "client", "t": t, "ok_per_s": (ok / bin_s).tolist(),
                  "errors_per_s": (bad / bin_s).tolist(), "output_tokens_per_s": (tokens / bin_s).tolist()}
    return throughput, {k: {"t": t, "value": (v / bin_s).tolist()} for k, v in sorted(per_kind.items())}


def _gauges(rows, name: str, label: str) -> dict[str, dict[str, list]]:
    """Per value of `label`: the gauge `name` over time."""
    out: dict[str, dict[str, list]] = defaultdict(lambda: {"t": [], "value": []})
    for t, values in rows:
        for key, v in values.items():
            metric, labels = _split_key(key)
            if metric == name:
                series = out[labels.get(label, "")]
                series["t"].append(t)
                series["value"].append(v)
    return dict(sorted(out.items()))


def _rates(rows, name: str, label: str) -> dict[str, dict[str, list]]:
    """Per value of `label`: the counter `name`'s increase per second between scrapes."""
    out: dict[str, dict[str, list]] = {}
    for key, g in _gauges(rows, name, label).items():
        t, v = g["t"], g["value"]
        out[key] = {"t": [(a + b) / 2 for a, b in zip(t, t[1:])],
                    "value": [max(0.0, (y - x) / (b - a)) if b > a else 0.0
                              for a, b, x, y in zip(t, t[1:], v, v[1:])]}
    return out


def _hit_rates(rows) -> dict[str, dict[str, list]]:
    hits = _gauges(rows, "loraserve_adapter_hits_total", "tier")
    misses = _gauges(rows, "loraserve_adapter_misses_total", "tier")
    out = {}
    for tier, h in hits.items():
        m = misses.get(tier)
        if m is None or len(m["value"]) != len(h["value"]):
            continue
        t, rate = [], []
        for i in range(1, len(h["t"])):
            dh = h["value"][i] - h["value"][i - 1]
            dm = m["value"][i] - m["value"][i - 1]
            t.append((h["t"][i] + h["t"][i - 1]) / 2)
            rate.append(dh / (dh + dm) if dh + dm > 0 else None)
        out[tier] = {"t": t, "value": rate}
    return out


def server_throughput(rows) -> dict:
    """Requests/s answered, from the server's loraserve_requests_total{status} (wrk runs)."""
    by_status = _rates(rows, "loraserve_requests_total", "status")
    if not by_status:
        return {"source": "server", "t": [], "ok_per_s": [], "errors_per_s": [], "output_tokens_per_s": []}
    t = next(iter(by_status.values()))["t"]
    ok = [sum(s["value"][i] for k, s in by_status.items() if k.startswith("2") and i < len(s["value"]))
          for i in range(len(t))]
    bad = [sum(s["value"][i] for k, s in by_status.items() if not k.startswith("2") and i < len(s["value"]))
           for i in range(len(t))]
    return {"source": "server", "t": t, "ok_per_s": ok, "errors_per_s": bad, "output_tokens_per_s": []}


def build_series(report: dict, samples: Sequence[Any] | None, rows, bin_s: float = 1.0,
                 latency: dict | None = None) -> dict:
    """Every series of the report. `samples`: the client's per-request samples (None: a wrk run,
    whose `latency` = {"e2e_s": cdf} stands in); `rows`: the MetricsTimeline's rows."""
    if samples is not None:
        throughput, errors_over_time = client_throughput(samples, report["wall_s"], bin_s)
        ok = [s for s in samples if s.ok]
        latency_cdf = {"e2e_s": cdf([s.e2e for s in ok]),
                       "ttft_s": cdf([s.ttft for s in ok if s.ttft is not None]),
                       "ttft_cold_s": cdf([s.ttft for s in ok if s.cold and s.ttft is not None]),
                       "ttft_hot_s": cdf([s.ttft for s in ok if not s.cold and s.ttft is not None]),
                       "itl_s": cdf([gap for s in ok for gap in s.itl])}
    else:
        throughput, errors_over_time = server_throughput(rows), {}
        latency_cdf = {"e2e_s": (latency or {}).get("e2e_s", cdf([])), "ttft_s": cdf([]),
                       "ttft_cold_s": cdf([]), "ttft_hot_s": cdf([]), "itl_s": cdf([])}
    return {
        "throughput": throughput,
        "latency_cdf": latency_cdf,
        "errors_by_status": dict(sorted(report["error_kinds"].items())),
        "errors_over_time": errors_over_time,
        "hit_rate": _hit_rates(rows),
        "page_ins_per_s": _rates(rows, "loraserve_adapter_page_in_seconds_count", "source"),
        "evictions_per_s": _rates(rows, "loraserve_adapter_evictions_total", "tier"),
        "resident_adapters": _gauges(rows, "loraserve_adapter_resident", "tier"),
        "resident_bytes": _gauges(rows, "loraserve_adapter_resident_bytes", "tier"),
        "memory_bytes": _memory(rows),
    }


def _memory(rows) -> dict[str, dict[str, list]]:
    """Resident memory per process, apart by kind where the server says it
    (`loraserve_process_rss_bytes`: "<process> anonymous" and "<process> file-backed"), else
    each process's total (an older server)."""
    by_kind: dict[str, dict[str, list]] = defaultdict(lambda: {"t": [], "value": []})
    for t, values in rows:
        for key, v in values.items():
            metric, labels = _split_key(key)
            if metric == "loraserve_process_rss_bytes":
                kind = "file-backed" if labels.get("kind") == "file" else labels.get("kind", "")
                series = by_kind[f"{labels.get('process', '')} {kind}"]
                series["t"].append(t)
                series["value"].append(v)
    if by_kind:
        return dict(sorted(by_kind.items()))
    memory = {}
    for label, name in (("api_server", "process_resident_memory_bytes"),
                        ("engine_core", "loraserve_engine_core_rss_bytes")):
        memory[label] = _gauges(rows, name, "").get("", {"t": [], "value": []})
    return memory


# -- the page ---------------------------------------------------------------------------------------
def _svg(fig) -> str:
    """A figure as inline SVG markup (no XML prolog, no metadata block; text kept as text)."""
    from matplotlib import rc_context

    buf = io.StringIO()
    with rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    return re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)


def _figure(title: str, xlabel: str, ylabel: str, width: float = 6.4, height: float = 3.2):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _empty(ax, text: str = "no data in this run") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _points(g: dict[str, list], scale: float) -> list[tuple[float, float]]:
    """A series' (t, value * scale) where it has a value."""
    return [(t, v * scale) for t, v in zip(g["t"], g["value"]) if v is not None]


def _finish(fig, ax, drawn: bool):
    """The chart: a legend and a zero floor once a line is drawn, else the no-data mark."""
    if drawn:
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        _empty(ax)
    return fig


def _lines(title: str, ylabel: str, groups: dict[str, dict[str, list]], scale: float = 1.0,
           step: bool = False):
    fig, ax = _figure(title, "seconds into the run", ylabel)
    drawn = False
    for name, g in groups.items():
        pts = _points(g, scale)
        if pts:
            xs, ys = zip(*pts)
            (ax.step if step else ax.plot)(xs, ys, label=name or "-", marker="." if len(xs) < 40 else None,
                                           **({"where": "mid"} if step else {}))
            drawn = True
    return _finish(fig, ax, drawn)


def _memory_chart(groups: dict[str, dict[str, list]]):
    """Resident memory, anonymous solid and file-backed dashed (same colour per process): the
    page cache of a catalog read end to end grows by gigabytes and is reclaimable; summed with
    the process's own memory it reads as a leak."""
    fig, ax = _figure("Resident memory: anonymous (own) and file-backed (mapped files, reclaimable)",
                      "seconds into the run", "MiB")
    colours = {"api_server": "tab:blue", "engine_core": "tab:orange"}
    drawn = False
    for name, g in groups.items():
        pts = _points(g, 1 / 2 ** 20)
        if pts:
            xs, ys = zip(*pts)
            process = name.split(" ", 1)[0]
            ax.plot(xs, ys, label=name, color=colours.get(process),
                    linestyle="--" if name.endswith("file-backed") else "-",
                    marker="." if len(xs) < 40 else None)
            drawn = True
    return _finish(fig, ax, drawn)


def _charts(series: dict) -> list[tuple[str, str, Any]]:
    """(heading, PNG file stem, matplotlib Figure) per chart."""
    from matplotlib import rc_context

    charts = []
    with rc_context({"font.size": 9}):
        th = series["throughput"]
        fig, ax = _figure(f"Throughput ({th['source']} side)", "seconds into the run", "requests/s")
        if th["t"]:
            ax.step(th["t"], th["ok_per_s"], where="mid", label="ok")
            if any(th["errors_per_s"]):
                ax.step(th["t"], th["errors_per_s"], where="mid", label="failed", color="tab:red")
            ax.legend(fontsize=8)
            ax.set_ylim(bottom=0)
        else:
            _empty(ax)
        charts.append(("Throughput over time", "throughput", fig))

        fig, ax = _figure("Latency distribution", "milliseconds (log scale)", "fraction of requests ≤ x")
        drawn = False
        lat = series["latency_cdf"]
        for name, c in (("end to end", lat["e2e_s"]), ("TTFT", lat["ttft_s"]),
                        ("TTFT, cold adapters", lat["ttft_cold_s"]),
                        ("TTFT, hot adapters", lat["ttft_hot_s"]),
                        ("inter-token latency", lat["itl_s"])):
            if c["x"]:
                ax.plot([x * 1000 for x in c["x"]], c["p"], label=name, drawstyle="steps-post")
                drawn = True
        if drawn:
            ax.set_xscale("log")
            ax.set_ylim(0, 1.01)
            ax.legend(fontsize=8)
        else:
            _empty(ax)
        charts.append(("Latency, TTFT (cold and hot adapters) and inter-token latency (CDF)",
                       "latency", fig))

        charts.append(("Adapter tier hit rates", "hit_rate",
                       _lines("Hit rate per scrape interval", "hits / lookups", series["hit_rate"])))
        charts.append(("Page-ins", "page_ins", _lines("Adapters paged in, by source tier",
                                                      "page-ins/s", series["page_ins_per_s"])))
        charts.append(("Resident adapters", "resident_adapters",
                       _lines("Adapters resident, by tier", "adapters", series["resident_adapters"],
                              step=True)))
        charts.append(("Memory", "memory", _memory_chart(series["memory_bytes"])))

        errors = series["errors_by_status"]
        fig, ax = _figure("Failed requests by kind", "", "", height=0.8 + 0.35 * max(2, len(errors)))
        if errors:
            ax.barh(list(errors), list(errors.values()), color="tab:red")
            ax.set_xlabel("requests")
        else:
            _empty(ax, "no errors")
            ax.set_yticks([])
        charts.append(("Errors", "errors", fig))
    return charts


_STYLE = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 72em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
pre { background: #f5f5f5; padding: 0.8em; overflow-x: auto; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(30em, 1fr)); gap: 1em; }
.grid svg { width: 100%; height: auto; }
table { border-collapse: collapse; } td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; text-align: right; }
"""


def render_html(report: dict, series: dict, text: str, charts: list | None = None) -> str:
    """The page; `charts`: `_charts(series)` when the caller made them already."""
    cfg = report["config"]
    title = f"loraserve loadtest: {cfg['url']}"
    figures = "\n".join(f"<section><h2>{html.escape(h)}</h2>\n{_svg(fig)}\n</section>"
                        for h, _, fig in (charts if charts is not None else _charts(series)))
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in sorted(cfg.items()))
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style></head>\n<body>\n"
            f"<h1>{html.escape(title)}</h1>\n<pre>{html.escape(text)}</pre>\n"
            f"<div class=\"grid\">\n{figures}\n</div>\n"
            f"<h2>Configuration</h2>\n<table>{rows}</table>\n"
            f"<p>The numbers behind every chart are in summary.json and series.csv beside this "
            f"page, and each chart is there as a PNG.</p>\n"
            f"</body></html>\n")


def write_report(directory: str | Path, report: dict, series: dict, text: str) -> tuple[Path, Path]:
    """Write report.html, summary.json (the report plus "series"), a PNG per chart and
    series.csv under `directory`; returns (report.html, summary.json)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"
    summary.write_text(json.dumps({**report, "series": series}, indent=1, allow_nan=False) + "\n")
    charts = _charts(series)
    page = out / "report.html"
    page.write_text(render_html(report, series, text, charts))
    for _, stem, fig in charts:
        fig.savefig(out / f"{stem}.png", format="png", dpi=120, bbox_inches="tight")
    write_series_csv(out / "series.csv", series)
    return page, summary
