"""`settle_heap`: a serving process freezes its start-up heap and collects generation 0 less often."""
import subprocess
import sys

from loraserve.heap import GEN0_THRESHOLD


def test_settle_heap_freezes_and_raises_the_threshold():
    code = ("import gc\nfrom loraserve.heap import settle_heap\nbefore = gc.get_threshold()\n"
            "settle_heap()\nprint(before[0], gc.get_threshold()[0], gc.get_threshold()[1:] == before[1:],"
            " gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["700", str(GEN0_THRESHOLD), "True", "True"]
