"""`BoundedLRU`: the one count-bounded least-recently-used map of the project.

A map of at most `capacity` entries, least recently used first: `get` makes an entry the most
recently used, `put` inserts (or replaces) one as the most recently used and evicts from the
least recently used end beyond `capacity`. `peek`, `oldest` and `in` look without reordering.

With `lock=True` (the default) every operation runs under one lock, so the map may be shared by
threads (pager workers decoding at once, the catalog's readers); `lock=False` is for state owned
by one thread or event loop, where a lock is pure cost.

Users: `catalog.store.ResolveCache`, `catalog.layout` (the checked layouts),
`engine.client.warm_refs.WarmRefs`, `server.tinker.state.Recent`. The CPU cache
(`adapters.cpu_cache.CpuCache`) is bounded by bytes, not entries, and counts hits, misses,
evictions and rejections under the same lock: it keeps its own policy.

This module imports nothing from loraserve (the catalog is the lowest layer).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = ["BoundedLRU"]

_MISSING = object()


class BoundedLRU(Generic[K, V]):
    """At most `capacity` entries, least recently used out first (see module doc)."""

    __slots__ = ("capacity", "_items", "_lock")

    def __init__(self, capacity: int, *, lock: bool = True) -> None:
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock() if lock else nullcontext()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of `key`, now the most recently used; `default` when absent."""
        with self._lock:
            value = self._items.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._items.move_to_end(key)
            return value

    def get_if(self, key: K, accept: Callable[[V], bool]) -> V | None:
        """The value of `key` if `accept(value)`, then the most recently used; otherwise None and
        the order is left as it was (a stale entry is not refreshed)."""
        with self._lock:
            value = self._items.get(key, _MISSING)
            if value is _MISSING or not accept(value):
                return None
            self._items.move_to_end(key)
            return value

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value of `key` without making it recently used; `default` when absent."""
        with self._lock:
            return self._items.get(key, default)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Set `key` to `value` as the most recently used; returns the entries evicted to stay
        within `capacity`, least recently used first."""
        with self._lock:
            items = self._items
            items[key] = value
            items.move_to_end(key)
            evicted = []
            while len(items) > self.capacity and items:
                evicted.append(items.popitem(last=False))
            return evicted

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove `key`; its value, or `default` when absent."""
        with self._lock:
            return self._items.pop(key, default)

    def oldest(self) -> tuple[K, V] | None:
        """The least recently used entry (not reordered), or None when empty."""
        with self._lock:
            for item in self._items.items():
                return item
            return None

    def pop_oldest(self) -> tuple[K, V] | None:
        """Remove and return the least recently used entry, or None when empty."""
        with self._lock:
            return self._items.popitem(last=False) if self._items else None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def keys(self) -> list[K]:
        """The keys, least recently used first (a copy)."""
        with self._lock:
            return list(self._items)

    def items(self) -> list[tuple[K, V]]:
        """The entries, least recently used first (a copy)."""
        with self._lock:
            return list(self._items.items())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"BoundedLRU(capacity={self.capacity}, entries={len(self._items)})"
