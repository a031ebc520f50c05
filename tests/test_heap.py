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



_REFAULTS = """
import resource, sys, torch
from loraserve.heap import hold_freed_memory
if sys.argv[1] == "hold":
    assert hold_freed_memory()
def step(scale):  # a step's activations: a chain of 2-16 MiB tensors, each freed after the next
    x = torch.ones(scale * 1024, 128)
    for _ in range(20):
        x = torch.cat([x, x[:1]]) * 1.5
for s in (4, 8, 16, 32):
    step(s)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for s in (4, 32, 8, 16, 32, 4) * 3:
    step(s)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _refaults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _REFAULTS, mode], capture_output=True, text=True,
                         check=True).stdout
    return int(out.split()[-1])


def test_freed_activations_are_reused_not_refaulted():
    """Steps of varying size, after a warm-up that reached the largest: with glibc's defaults
    their freed blocks go back to the kernel and every step faults its pages in again (65,000-
    565,000 faults here: glibc's dynamic mmap threshold moves with the order of frees, so the
    default's count varies by run); `hold_freed_memory` keeps them in the heap (4,000-7,200)."""
    default, held = _refaults("default"), _refaults("hold")
    assert held * 4 < default, (held, default)
