"""The load test's latency figures: inter-token latency, tokens/s and latency over time, hot and
cold adapters, goodput under TTFT/ITL SLOs, and the exit when the error rate passes
--max-error-rate. Against synthetic samples (exact numbers) and the stub server of
test_loadtest (small bounded runs)."""
import argparse

import pytest
from test_loadtest import TOKENS, config, stub  # noqa: F401  (stub: the fixture)

from loraserve.loadgen import latency
from loraserve.loadgen.cli import check_error_rate
from loraserve.loadgen.sample import Sample
from loraserve.loadtest import add_subcommand, format_report, run_loadtest


def _samples() -> list[Sample]:
    return [Sample(True, 1.0, 0.1, 4, start=0.0, itl=[0.2, 0.3, 0.4], cold=True),
            Sample(True, 0.5, 0.05, 2, start=1.5, itl=[0.1]),
            Sample(True, 0.5, 0.4, 2, start=3.0, itl=[0.05]),
            Sample(False, 0.2, error="http 404", start=3.5)]


def test_itl_is_every_gap_of_the_ok_requests() -> None:
    p = latency.itl(_samples())
    assert p["mean"] == pytest.approx((0.2 + 0.3 + 0.4 + 0.1 + 0.05) / 5)
    assert p["p50"] == pytest.approx(0.2)


def test_over_time_windows_by_request_end() -> None:
    series = latency.over_time(_samples(), wall=4.0, bins=4)
    assert series["t_s"] == [1.0, 2.0, 3.0, 4.0]
    assert series["ok"] == [0, 1, 1, 1]  # ends at 1.0, 2.0, 3.5 (the failure is not counted)
    assert series["output_tokens_per_s"] == [0.0, 4.0, 2.0, 2.0]
    assert series["ttft_p50_s"] == [None, 0.1, 0.05, 0.4]


def test_hot_and_cold() -> None:
    groups = latency.hot_cold(_samples())
    assert (groups["cold"]["requests"], groups["hot"]["requests"]) == (1, 2)
    assert groups["cold"]["ttft_s"]["p50"] == pytest.approx(0.1)
    assert groups["hot"]["e2e_s"]["mean"] == pytest.approx(0.5)


@pytest.mark.parametrize("ttft, itl, good", [
    (None, None, 3),   # no SLO: every ok request
    (0.2, None, 2),    # the 0.4 s TTFT misses
    (None, 0.2, 2),    # the first request's mean gap is 0.3 s
    (0.2, 0.2, 1),
])
def test_goodput(ttft, itl, good) -> None:
    g = latency.goodput(_samples(), wall=4.0, slo_ttft=ttft, slo_itl=itl)
    assert g["good"] == good
    assert g["good_per_s"] == pytest.approx(good / 4.0) and g["share"] == pytest.approx(good / 4)


def test_a_run_reports_them(stub) -> None:  # noqa: F811
    url, seen = stub
    report = run_loadtest(config(url, adapters=["acme/a", "cold/b"], max_requests=8, dist="cycle",
                                 slo_ttft=60.0, slo_itl=60.0))
    assert report["ok"] == 8 and report["error_rate"] == 0
    assert report["itl_s"]["p50"] > 0  # TOKENS chunks: TOKENS - 1 gaps per request
    assert report["hot_cold"]["cold"]["requests"] == 2  # the first of each adapter
    assert report["hot_cold"]["hot"]["requests"] == 6
    assert report["goodput"]["good"] == 8 and report["goodput"]["share"] == 1.0
    assert sum(report["over_time"]["ok"]) == 8
    text = format_report(report)
    for line in ("itl ", "cold ttft", "hot e2e", "goodput ", "tok/s"):
        assert line in text
    strict = run_loadtest(config(url, adapters=["acme/a"], max_requests=2, slo_ttft=1e-9))
    assert strict["goodput"]["good"] == 0


def test_the_error_rate_gate(stub, tmp_path) -> None:  # noqa: F811
    url, _ = stub
    ids = tmp_path / "ids.txt"
    ids.write_text("acme/a\nmissing/x\n")
    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    base = ["loadtest", "--url", url, "--adapters", str(ids), "--requests", "4", "--dist", "cycle",
            "--concurrency", "1", "--no-progress"]
    at_bound = parser.parse_args([*base, "--max-error-rate", "0.5"])
    assert at_bound.func(at_bound) == 0  # 2 of 4 failed: at the bound, not past it
    args = parser.parse_args([*base, "--max-error-rate", "0.25"])
    with pytest.raises(RuntimeError, match="error rate 50.0% is above --max-error-rate 25.0%"):
        args.func(args)
    check_error_rate({"error_rate": 0.3}, None)  # no gate: never fails
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--max-error-rate", "x"])


def test_the_html_reports_series_carry_them() -> None:
    from loraserve.loadgen.report import build_series
    from loraserve.loadgen.summary import summarize

    samples = _samples()
    report = summarize(config("http://127.0.0.1:1"), samples, 4.0)
    cdfs = build_series(report, samples, [], bin_s=1.0)["latency_cdf"]
    assert cdfs["itl_s"]["x"][0] == pytest.approx(0.05) and cdfs["itl_s"]["p"][-1] == 1.0
    assert len(cdfs["ttft_cold_s"]["x"]) == 1 and len(cdfs["ttft_hot_s"]["x"]) == 2
