"""Which adapter references were resolved a moment ago, so the next resolve may run inline.

A request's adapter is resolved by a catalog read (LMDB), on a worker thread because a cold read
may wait on the disk. Handing the read to a thread and back costs more than the read when its
pages are in memory: two thread wake-ups and a GIL hand-off, ~0.3 ms of a 1-token request's
latency and ~12% of the API process's CPU under load (bench/hot_path.py's profile). A reference
resolved within the last `ttl_s` seconds read pages that are almost surely still cached, so it is
resolved on the event loop. The catalog is read every time either way (nothing is cached but
the fact that a read was recent): a promote or rollback is seen at once.
"""
from __future__ import annotations

import time
from collections import OrderedDict


class WarmRefs:
    def __init__(self, ttl_s: float = 5.0, capacity: int = 4096):
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()

    def is_warm(self, ref: str) -> bool:
        at = self._seen.get(ref)
        return at is not None and time.monotonic() - at < self.ttl_s

    def touch(self, ref: str) -> None:
        """`ref` was just resolved (successfully)."""
        self._seen[ref] = time.monotonic()
        self._seen.move_to_end(ref)
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
