"""The CPU tier: a byte-bounded LRU of checksum-verified adapter revisions in serving layout.

Entries are `AdapterWeights` keyed by `(adapter_id, revision)`; revisions are immutable, so an
entry never goes stale. The total `nbytes` of the entries never exceeds `max_bytes`, nor their
number `max_entries` when one is set (vLLM's `--max-cpu-loras` counts adapters): `put` evicts
least-recently-used entries to make room, and an entry larger than the whole cache is not kept.
With `pin_memory` (CUDA only) tensors are copied into page-locked memory so the copy to the device
pool can run asynchronously. Thread-safe: pager workers `put`, the engine thread `get`s.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict

import torch

from loraserve.adapters.slabs import SlabWeights
from loraserve.adapters.stats import CacheStats
from loraserve.adapters.weights import AdapterKey, weights_nbytes

__all__ = ["CpuCache"]


class CpuCache:
    """Byte-bounded LRU of adapter weights (see module doc)."""

    def __init__(self, max_bytes: int, pin_memory: bool = False, max_entries: int | None = None):
        if max_bytes < 0:
            raise ValueError(f"CPU cache size must be >= 0 bytes, got {max_bytes}")
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"CPU cache entry bound must be >= 1, got {max_entries}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory needs CUDA; there is no CUDA device here")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._entries: OrderedDict[AdapterKey, tuple[object, int]] = OrderedDict()  # LRU first
        self._stats = CacheStats(max_bytes=max_bytes)

    def get(self, key: AdapterKey):
        """The cached weights of `key` (a hit, now most recently used), or None (a miss)."""
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                self._stats.misses += 1
                return None
            self._stats.hits += 1
            self._entries.move_to_end(key)
            return item[0]

    def put(self, key: AdapterKey, weights) -> bool:
        """Insert `weights` as most recently used, evicting LRU entries to stay within `max_bytes`.

        Returns whether it is kept: an entry larger than the whole cache is not.
        """
        nbytes = weights_nbytes(weights)
        if nbytes > self.max_bytes:
            with self._lock:
                self._stats.rejected += 1
                old = self._entries.pop(key, None)
                if old is not None:
                    self._stats.bytes -= old[1]
            return False
        if self.pin_memory and not isinstance(weights, SlabWeights):  # slabs are pinned blocks
            weights = _pinned(weights)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._stats.bytes -= old[1]
            while self._stats.bytes + nbytes > self.max_bytes or self._full():
                _, (_, freed) = self._entries.popitem(last=False)
                self._stats.bytes -= freed
                self._stats.evictions += 1
            self._entries[key] = (weights, nbytes)
            self._stats.bytes += nbytes
            return True

    def _full(self) -> bool:
        """No room for one more entry under `max_entries` (lock held)."""
        return self.max_entries is not None and len(self._entries) >= self.max_entries

    def discard(self, key: AdapterKey) -> bool:
        """Drop `key` (not counted as an eviction); returns whether it was cached."""
        with self._lock:
            item = self._entries.pop(key, None)
            if item is not None:
                self._stats.bytes -= item[1]
            return item is not None

    def __contains__(self, key: AdapterKey) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[AdapterKey]:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def recent(self, n: int) -> list[AdapterKey]:
        """The n most recently used keys, most recent first: O(n), whatever the cache holds (the
        engine snapshot asks every step; copying all ~37,000 keys of a full 256 MiB cache of small
        adapters took 37% of the engine thread in a 1M-adapter sweep, bench/RESULTS.md)."""
        with self._lock:
            return list(itertools.islice(reversed(self._entries), max(n, 0)))

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters and gauges."""
        with self._lock:
            self._stats.entries = len(self._entries)
            return self._stats.copy()


def _pinned(weights):
    """The same weights with every tensor in page-locked host memory."""
    tensors = {name: t.pin_memory() for name, t in weights.tensors.items()}
    if dataclasses.is_dataclass(weights):
        return dataclasses.replace(weights, tensors=tensors)
    weights.tensors = tensors
    return weights
