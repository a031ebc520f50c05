"""Where a request's adapter reference is resolved: on the event loop, or on a worker thread.

A ref is resolved by a catalog read (LMDB through a memory map). When its pages are in memory the
read takes tens of microseconds (~30 µs for a never-seen adapter of a 1,000,000-revision
catalog, two B-tree lookups and the shard's health check), while handing it to a thread and back
costs two thread wake-ups and GIL hand-offs: ~0.3 ms of an idle request's latency, and 3-27 ms
under a cold sweep's load, where every hand-off waits behind a busy event loop (bench/RESULTS.md,
"The cold path at namespace scale"). So refs are resolved inline, with two exceptions that keep
a disk from stalling the loop:

- reads have been slow: `slow_reads` inline reads within `slow_window_s` seconds that each took
  longer than `slow_s` (pages came from the disk, not the page cache) send the refs not
  resolved within the last `ttl_s` seconds to a worker thread for the next `backoff_s` seconds.
  One slow read alone is not the disk: on a loaded machine a read now and then waits for a CPU
  or a garbage collection (2 of 20,500 reads in a cold run took over 2 ms, one 76 ms), and each
  sent every cold ref to a thread for `backoff_s`, at ~0.04 ms of CPU a request (issue 41);
- `inline_cold=False` sends them there always (the pre-measurement behaviour).

A ref resolved within the last `ttl_s` seconds read pages that are almost surely still cached:
it is resolved inline either way. The catalog is read every time (nothing is cached here but
the fact that a read was recent or slow): a promote or rollback is seen at once.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

from loraserve.catalog.lru import BoundedLRU


class WarmRefs:
    def __init__(self, ttl_s: float = 5.0, capacity: int = 4096, *, inline_cold: bool = True,
                 slow_s: float = 0.002, backoff_s: float = 10.0, slow_reads: int = 3,
                 slow_window_s: float = 1.0):
        self.ttl_s = ttl_s
        self.inline_cold = inline_cold
        self.slow_s = slow_s
        self.backoff_s = backoff_s
        self.slow_window_s = slow_window_s
        # when the last `slow_reads` slow reads ended (its length bound is that count)
        self._slow: deque[float] = deque(maxlen=max(1, slow_reads))
        self._seen: BoundedLRU[str, float] = BoundedLRU(capacity, lock=False)  # event loop only
        self._slow_until = float("-inf")  # cold refs go to a thread until then

    def is_warm(self, ref: str) -> bool:
        at = self._seen.peek(ref)
        return at is not None and time.monotonic() - at < self.ttl_s

    def inline(self, ref: str) -> bool:
        """Whether to resolve `ref` on the event loop now."""
        return self.is_warm(ref) or self.cold_inline()

    def cold_inline(self) -> bool:
        """Whether a ref not resolved recently is read on the event loop now."""
        return self.inline_cold and time.monotonic() >= self._slow_until

    async def call(self, ref: str, fn, *args):
        """`fn(*args)`, the read for `ref`: on the event loop while `inline(ref)`, timed (`timed`),
        else on a worker thread; `ref` is warm afterwards (`touch`)."""
        if self.inline(ref):
            started = time.perf_counter()
            try:
                result = fn(*args)
            finally:
                self.timed(time.perf_counter() - started)
        else:
            result = await asyncio.to_thread(fn, *args)
        self.touch(ref)
        return result

    def timed(self, seconds: float) -> None:
        """An inline resolve took `seconds`: the `slow_reads`-th past `slow_s` within
        `slow_window_s` sends cold refs to a thread for a while."""
        if seconds <= self.slow_s:
            return
        now = time.monotonic()
        self._slow.append(now)
        if len(self._slow) == self._slow.maxlen and now - self._slow[0] <= self.slow_window_s:
            self._slow_until = now + self.backoff_s
            self._slow.clear()

    def touch(self, ref: str) -> None:
        """`ref` was just resolved (successfully)."""
        self._seen.put(ref, time.monotonic())

    @property
    def capacity(self) -> int:
        return self._seen.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._seen.capacity = value
