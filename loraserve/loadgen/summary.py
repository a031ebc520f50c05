"""A load test's report: `summarize` (the built-in clients' samples), `summarize_wrk` (a wrk
run, in the same shape) and `format_report` (the small table the command prints)."""
from __future__ import annotations

from dataclasses import asdict

from loraserve.loadgen import latency
from loraserve.loadgen.config import LoadTestConfig
from loraserve.loadgen.latency import percentiles as _percentiles
from loraserve.loadgen.sample import Sample


def _hit_rates(before: dict | None, after: dict | None) -> dict[str, float | None] | None:
    """Per tier: hits / (hits + misses) over the run (None when the tier saw no lookups)."""
    if before is None or after is None:
        return None
    rates: dict[str, float | None] = {}
    for tier, counts in after.items():
        prev = before.get(tier, {"hits": 0.0, "misses": 0.0})
        hits, misses = counts["hits"] - prev["hits"], counts["misses"] - prev["misses"]
        rates[tier] = hits / (hits + misses) if hits + misses > 0 else None
    return rates


def summarize(cfg: LoadTestConfig, samples: list[Sample], wall: float,
              before: dict | None = None, after: dict | None = None) -> dict:
    """The report: counts, throughput, latency percentiles (seconds), errors by kind, hit rates."""
    ok = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.error or "error"] = errors.get(s.error or "error", 0) + 1
    tokens = sum(s.output_tokens for s in ok)
    config = asdict(cfg)
    config.pop("api_key")
    config["adapters"] = len(cfg.adapters)
    return {
        "mode": "closed" if cfg.concurrency is not None else "open",
        "config": config,
        "wall_s": wall,
        "requests": len(samples), "ok": len(ok), "errors": len(samples) - len(ok), "error_kinds": errors,
        "req_per_s": len(ok) / wall if wall > 0 else 0.0,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": _percentiles([s.ttft for s in ok if s.ttft is not None]),
        "e2e_s": _percentiles([s.e2e for s in ok]),
        "itl_s": latency.itl(samples),
        "error_rate": (len(samples) - len(ok)) / len(samples) if samples else 0.0,
        "goodput": latency.goodput(samples, wall, cfg.slo_ttft, cfg.slo_itl),
        "hot_cold": latency.hot_cold(samples),
        "over_time": latency.over_time(samples, wall),
        "adapter_hit_rate": _hit_rates(before, after),
    }


def summarize_wrk(cfg: LoadTestConfig, result: dict, wall: float,
                  before: dict | None = None, after: dict | None = None) -> dict:
    """The report of a wrk run, in `summarize`'s shape: latencies from wrk's histogram, no TTFT,
    output tokens assumed to be max_tokens per ok request (wrk does not read the events)."""
    statuses = {int(k): v for k, v in result["statuses"].items()}
    ok = sum(n for status, n in statuses.items() if status == 200)
    errors = {f"http {status}": n for status, n in statuses.items() if status != 200}
    errors.update({f"wrk {kind}": n for kind, n in result["errors"].items() if n and kind != "timeout"})
    if result["errors"]["timeout"]:
        errors["ResponseTimeout"] = result["errors"]["timeout"]
    failed = sum(errors.values())
    wall = result["duration_us"] / 1e6 or wall
    pct = dict((p, us / 1e6) for p, us in result["latency_us"]["percentiles"])
    tokens = ok * cfg.max_tokens if cfg.ignore_eos else 0
    config = asdict(cfg)
    config.pop("api_key")
    config["adapters"] = len(cfg.adapters)
    none = {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "mode": "closed", "config": config, "wall_s": wall,
        "requests": ok + failed, "ok": ok, "errors": failed, "error_kinds": errors,
        "req_per_s": ok / wall if wall > 0 else 0.0,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": dict(none),
        "e2e_s": none if ok == 0 else {"p50": pct.get(50.0), "p90": pct.get(90.0), "p99": pct.get(99.0),
                                       "mean": result["latency_us"]["mean"] / 1e6},
        "itl_s": dict(none),  # wrk reads no events: no ITL, goodput, hot/cold or timeline
        "error_rate": failed / (ok + failed) if ok + failed else 0.0,
        "goodput": None, "hot_cold": None, "over_time": None,
        "adapter_hit_rate": _hit_rates(before, after),
    }


def format_report(report: dict) -> str:
    """The report as a small table (latencies in milliseconds)."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    cfg = report["config"]
    load = f"rate {cfg['rate']}/s" if report["mode"] == "open" else f"concurrency {cfg['concurrency']}"
    lines = [f"loadtest {cfg['url']}: {report['mode']} loop, {load}, {cfg['adapters']} adapters "
             f"({cfg['dist']}), {report['wall_s']:.1f} s",
             f"requests  {report['requests']}  ok {report['ok']}  errors {report['errors']}"
             + "".join(f"  [{k}: {n}]" for k, n in sorted(report["error_kinds"].items())),
             f"req/s     {report['req_per_s']:.2f}",
             f"tokens/s  {report['output_tokens_per_s']:.1f}  (output)",
             f"{'ms':<9} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}"]
    for name, key in (("ttft", "ttft_s"), ("itl", "itl_s"), ("e2e", "e2e_s")):
        p = report[key]
        lines.append(f"{name:<9} {ms(p['p50']):>9} {ms(p['p90']):>9} {ms(p['p99']):>9} {ms(p['mean']):>9}")
    for name, group in (report.get("hot_cold") or {}).items():
        for what, key in (("ttft", "ttft_s"), ("e2e", "e2e_s")):
            p = group[key]
            lines.append(f"{name + ' ' + what:<9} {ms(p['p50']):>9} {ms(p['p90']):>9} "
                         f"{ms(p['p99']):>9} {ms(p['mean']):>9}  ({group['requests']} requests)")
    lines += _goodput_lines(report.get("goodput")) + _timeline_lines(report.get("over_time"))
    cpu = report.get("generator_cpu_us_per_request")
    lines.append(f"client    {cfg.get('client', 'httpx')}"
                 + ("" if cpu is None else f"  (generator CPU {cpu:.0f} us/request)"))
    rates = report["adapter_hit_rate"]
    if rates is None:
        lines.append("adapter hit rate: /metrics unavailable")
    else:
        shown = {t: "-" if r is None else f"{r:.1%}" for t, r in sorted(rates.items())}
        lines.append("adapter hit rate: " + ("  ".join(f"{t} {r}" for t, r in shown.items()) or "no counters"))
    return "\n".join(lines)


def _goodput_lines(good: dict | None) -> list[str]:
    if good is None:
        return []
    slo = ", ".join(f"{k} <= {v * 1000:.0f} ms" for k, v in
                    (("ttft", good["slo_ttft_s"]), ("mean itl", good["slo_itl_s"])) if v is not None)
    share = "-" if good["share"] is None else f"{good['share']:.1%}"
    return [f"goodput   {good['good_per_s']:.2f} req/s  {share} of requests"
            f"  ({slo or 'no SLO given: every ok request'})"]


def _timeline_lines(series: dict | None) -> list[str]:
    """Tokens/s and median latencies per window of the run."""
    if series is None:
        return []
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    lines = [f"{'until s':>9} {'ok':>6} {'tok/s':>9} {'ttft p50':>9} {'e2e p50':>9}"]
    for t, n, tps, ttft, e2e in zip(series["t_s"], series["ok"], series["output_tokens_per_s"],
                                    series["ttft_p50_s"], series["e2e_p50_s"]):
        lines.append(f"{t:>9.1f} {n:>6} {tps:>9.1f} {ms(ttft):>9} {ms(e2e):>9}")
    return lines
