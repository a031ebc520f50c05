"""Stats objects: the page-in histogram exposes Prometheus-style cumulative buckets; snapshots copy."""
import pytest

from loraserve.adapters.stats import PagerStats, page_in_histogram


def samples(hist) -> dict[tuple[str, str, str | None], float]:
    """`(sample name, source, le)` -> value, as the histogram would be scraped."""
    return {(s.name, s.labels["source"], s.labels.get("le")): s.value
            for family in hist.collect() for s in family.samples}


def test_histogram_buckets_are_cumulative_and_end_at_inf():
    hist = page_in_histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.labels(source="disk").observe(value)
    got = samples(hist)
    buckets = [(le, n) for (name, source, le), n in got.items()
               if name.endswith("_bucket") and source == "disk"]
    assert buckets == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert got["loraserve_adapter_page_in_seconds_count", "disk", None] == 4
    assert got["loraserve_adapter_page_in_seconds_sum", "disk", None] == pytest.approx(3.65)
    assert got["loraserve_adapter_page_in_seconds_count", "cpu", None] == 0  # exported from the start
    with pytest.raises(ValueError, match="sorted"):
        page_in_histogram(buckets=(1.0, 0.1))


def test_pager_stats_snapshot_is_independent():
    stats = PagerStats()
    snap = stats.copy()
    stats.disk_reads += 1
    stats.in_flight = 2
    assert snap.disk_reads == 0 and snap.in_flight == 0
