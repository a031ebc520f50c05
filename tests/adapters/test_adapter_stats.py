"""Stats objects: the page-in histogram exposes Prometheus-style cumulative buckets; snapshots copy."""
import pytest

from loraserve.adapters.stats import Histogram, PagerStats


def test_histogram_buckets_are_cumulative_and_end_at_inf():
    hist = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    assert hist.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert hist.count == 4 and hist.sum == pytest.approx(3.65)
    with pytest.raises(ValueError, match="increasing"):
        Histogram(buckets=(1.0, 0.1))


def test_pager_stats_snapshot_is_independent():
    stats = PagerStats()
    snap = stats.copy()
    stats.page_in_seconds["disk"].observe(0.2)
    stats.disk_reads += 1
    assert snap.page_in_seconds["disk"].count == 0 and snap.disk_reads == 0
    assert set(snap.page_in_seconds) == {"disk", "cpu"}
