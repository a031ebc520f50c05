"""What the Tinker SDK routes remember between requests: sessions, sampling sessions, futures.

All of it lives on the server's event loop (no locks, no threads) and is bounded:
- `Recent` maps (sessions, sampling sessions) forget what was not used for `idle_s`, and the
  least recently used entry beyond `max_items`;
- `FutureStore` keeps each finished future's answer `keep_s` after it finished (and at most
  `max_done` of them), and refuses new work beyond `max_pending` futures still running.
Expired entries are dropped as the maps are used (no background sweeper).
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from loraserve.catalog.lru import BoundedLRU
from loraserve.engine.types import ResolvedModel
from loraserve.server.tinker.runs import RunRegistry
from loraserve.server.tokens import TokenIssuer

V = TypeVar("V")


class Recent(Generic[V]):
    """A map that forgets entries idle for `idle_s` seconds or least recently used beyond
    `max_items`."""

    def __init__(self, max_items: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self._clock = clock
        # (last use, value), least recently used first: also oldest last use first
        self._items: BoundedLRU[str, tuple[float, V]] = BoundedLRU(max_items, lock=False)

    @property
    def max_items(self) -> int:
        return self._items.capacity

    @max_items.setter
    def max_items(self, value: int) -> None:
        self._items.capacity = value

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> V | None:
        """The value of `key` (now its most recent use), or None."""
        self._expire()
        found = self._items.peek(key)
        if found is None:
            return None
        self._items.put(key, (self._clock(), found[1]))
        return found[1]

    def put(self, key: str, value: V) -> None:
        self._items.put(key, (self._clock(), value))
        self._expire()

    def _expire(self) -> None:
        cutoff = self._clock() - self.idle_s
        while (oldest := self._items.oldest()) is not None and oldest[1][0] < cutoff:
            self._items.pop_oldest()


@dataclass(slots=True)
class SamplingSession:
    """A sampling client's target, fixed when it was created: `adapter` is the pinned revision
    (`tenant/name@rev`), None for the base model. `resolved`: the revision as decided when a
    training run saved it (its record made from the blob), so its samples need no catalog
    lookup while the catalog write is under way; None: resolved per sample (the directory)."""

    id: str
    owner: str | None            # key id of the principal that created it
    adapter: str | None
    model_path: str | None
    base_model: str | None
    resolved: ResolvedModel | None = None


@dataclass(slots=True)
class Future:
    """One asynchronous request (an asample): running until `answer` is set.

    `answer` is the body retrieve_future returns: a SampleResponse, or `{"error", "category"}`.
    `queue_state` is what a try_again says while it runs ("active", "paused_capacity").
    """

    request_id: str
    owner: str | None
    dedupe: tuple[str, int] | None = None   # (sampling_session_id, seq_id)
    queue_state: str = "active"
    answer: dict[str, Any] | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class FutureStore:
    """The app's futures by request id, and by (sampling_session_id, seq_id) for de-duplication
    (see module doc for the bounds)."""

    def __init__(self, keep_s: float = 300.0, max_done: int = 10_000, max_pending: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self.max_done = max_done
        self.max_pending = max_pending
        self._clock = clock
        self._futures: dict[str, Future] = {}
        self._done: OrderedDict[str, float] = OrderedDict()  # finished ids, oldest first
        self._by_seq: dict[tuple[str, int], str] = {}

    @property
    def pending(self) -> int:
        return len(self._futures) - len(self._done)

    def get(self, request_id: str, owner: str | None) -> Future | None:
        """The future `request_id` of `owner`; None when unknown, expired or another key's."""
        self._expire()
        future = self._futures.get(request_id)
        return future if future is not None and future.owner == owner else None

    def for_seq(self, dedupe: tuple[str, int], owner: str | None) -> Future | None:
        """The future already made for this (sampling session, seq id), if it is still kept."""
        self._expire()
        request_id = self._by_seq.get(dedupe)
        return None if request_id is None else self.get(request_id, owner)

    def add(self, future: Future) -> None:
        self._futures[future.request_id] = future
        if future.dedupe is not None:
            self._by_seq[future.dedupe] = future.request_id

    def discard(self, future: Future) -> None:
        """Forget a future that never started (its asample was refused)."""
        if self._futures.get(future.request_id) is future and future.answer is None:
            del self._futures[future.request_id]
            if future.dedupe is not None and self._by_seq.get(future.dedupe) == future.request_id:
                del self._by_seq[future.dedupe]

    def finish(self, future: Future, answer: dict[str, Any]) -> None:
        """Set `future`'s answer (once) and keep it for `keep_s`."""
        if future.answer is not None:
            return
        future.answer = answer
        future.finished.set()
        if future.request_id in self._futures:
            self._done[future.request_id] = self._clock()
        self._expire()

    def cancel_all(self) -> list[asyncio.Task]:
        """Cancel every running future's task (the server is stopping); returns those tasks."""
        tasks = [f.task for f in self._futures.values() if f.task is not None and not f.task.done()]
        for task in tasks:
            task.cancel()
        return tasks

    def _expire(self) -> None:
        cutoff = self._clock() - self.keep_s
        while self._done and (len(self._done) > self.max_done
                              or next(iter(self._done.values())) < cutoff):
            request_id, _ = self._done.popitem(last=False)
            future = self._futures.pop(request_id)
            if future.dedupe is not None and self._by_seq.get(future.dedupe) == request_id:
                del self._by_seq[future.dedupe]


@dataclass(slots=True)
class TinkerState:
    """The app's Tinker sessions, sampling sessions and futures (event loop only)."""

    sessions: Recent[str | None] = field(default_factory=lambda: Recent(100_000, 3600.0))
    samplers: Recent[SamplingSession] = field(
        default_factory=lambda: Recent(100_000, 24 * 3600.0))
    futures: FutureStore = field(default_factory=FutureStore)
    tokens: TokenIssuer = field(default_factory=TokenIssuer)  # used on an app without tenancy
    runs: RunRegistry = field(default_factory=lambda: RunRegistry(Path(tempfile.mkdtemp(prefix="loraserve-train-"))))
