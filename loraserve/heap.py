"""The garbage collector of a long-running server process, tuned once start-up is done.

Both processes allocate at a high rate per request (parsed bodies, asyncio objects, messages,
tensors' Python wrappers), so CPython's generation-0 collection ran every 700 allocations, and
every tenth of those swept generation 1, while generation 2 holds a start-up heap of a few
hundred thousand objects (torch, FastAPI, pydantic, the model's modules) that no collection will
ever free. `settle_heap()`, called by `loraserve serve` before it serves and by the engine core
once its engine is built, moves that heap into the permanent generation (`gc.freeze()`: full
collections no longer traverse it; vLLM's engine core does the same) and lets generation 0 grow
to `GEN0_THRESHOLD` allocations between collections. Reference counting still frees almost
everything at once; only garbage in reference cycles waits a little longer. Measured on the cold
sweep (256 connections, 10,000 adapters, bench/RESULTS.md): 537-551 -> 595-624 requests/s.

It also keeps the C heap's freed memory for the next step (`hold_freed_memory`): glibc's malloc
hands a block above its mmap threshold (128 KiB, rising with use to at most 32 MiB) straight to
the kernel when it is freed, and gives back the heap's free top past its trim threshold, so a
step whose activations are larger than the steps before it faulted its pages in anew every
time: up to 9,000 minor faults and 15-35 ms of kernel time in one prefill step of the cold-path
benchmark (bench/RESULTS.md, issue 29), none after.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc

GEN0_THRESHOLD = 10_000  # CPython's default is 700
# Blocks up to MMAP_THRESHOLD come from the heap and stay there when freed, and the heap gives
# back its free top only past TRIM_THRESHOLD: a step's activations are reused, not refaulted.
# The cost is the largest step's working set held resident between steps (what a GPU caching
# allocator does too); a block past MMAP_THRESHOLD (a huge prefill) still goes back at once.
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def settle_heap() -> None:
    """Collect what start-up left, freeze the survivors, raise the generation-0 threshold, and
    keep the C heap's freed memory for reuse."""
    hold_freed_memory()
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


def hold_freed_memory() -> bool:
    """Set glibc malloc's mmap and trim thresholds (fixed values also turn off its dynamic
    threshold). False where the C library is not glibc (musl, macOS): nothing to set."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
