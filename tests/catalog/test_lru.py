"""`BoundedLRU` against a model: a dict and a list of keys, least recently used first."""
from __future__ import annotations

import threading

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraserve.catalog.lru import BoundedLRU

KEYS = st.integers(0, 7)
VALUES = st.integers(-3, 3)


class LRUMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.capacity = 3
        self.lru: BoundedLRU[int, int] | None = None
        self.values: dict[int, int] = {}
        self.order: list[int] = []  # least recently used first

    @precondition(lambda self: self.lru is None)
    @rule(capacity=st.integers(0, 4), lock=st.booleans())
    def make(self, capacity: int, lock: bool) -> None:
        self.capacity = capacity
        self.lru = BoundedLRU(capacity, lock=lock)

    def _touch(self, key: int) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    @precondition(lambda self: self.lru is not None)
    @rule(key=KEYS)
    def get(self, key: int) -> None:
        assert self.lru.get(key, "absent") == self.values.get(key, "absent")
        if key in self.values:
            self._touch(key)

    @precondition(lambda self: self.lru is not None)
    @rule(key=KEYS, at_least=VALUES)
    def get_if(self, key: int, at_least: int) -> None:
        got = self.lru.get_if(key, lambda v: v >= at_least)
        if key in self.values and self.values[key] >= at_least:
            assert got == self.values[key]
            self._touch(key)
        else:
            assert got is None

    @precondition(lambda self: self.lru is not None)
    @rule(key=KEYS)
    def peek(self, key: int) -> None:
        assert self.lru.peek(key, "absent") == self.values.get(key, "absent")
        assert (key in self.lru) == (key in self.values)

    @precondition(lambda self: self.lru is not None)
    @rule(key=KEYS, value=VALUES)
    def put(self, key: int, value: int) -> None:
        evicted = self.lru.put(key, value)
        self.values[key] = value
        self._touch(key)
        expected = []
        while len(self.order) > self.capacity:
            old = self.order.pop(0)
            expected.append((old, self.values.pop(old)))
        assert evicted == expected

    @precondition(lambda self: self.lru is not None)
    @rule(key=KEYS)
    def pop(self, key: int) -> None:
        assert self.lru.pop(key, "absent") == self.values.pop(key, "absent")
        if key in self.order:
            self.order.remove(key)

    @precondition(lambda self: self.lru is not None)
    @rule()
    def oldest_and_pop_oldest(self) -> None:
        expected = (self.order[0], self.values[self.order[0]]) if self.order else None
        assert self.lru.oldest() == expected
        assert self.lru.pop_oldest() == expected
        if self.order:
            del self.values[self.order.pop(0)]

    @precondition(lambda self: self.lru is not None)
    @rule()
    def clear(self) -> None:
        self.lru.clear()
        self.values.clear()
        self.order.clear()

    @precondition(lambda self: self.lru is not None)
    @rule(capacity=st.integers(0, 4))
    def shrink_or_grow(self, capacity: int) -> None:
        """A new capacity applies from the next put on."""
        self.lru.capacity = self.capacity = capacity

    @invariant()
    def same_as_the_model(self) -> None:
        if self.lru is None:
            return
        assert self.lru.keys() == self.order
        assert self.lru.items() == [(k, self.values[k]) for k in self.order]
        assert len(self.lru) == len(self.values)


TestBoundedLRU = LRUMachine.TestCase
TestBoundedLRU.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_replaced_key_becomes_the_most_recent_without_evicting() -> None:
    lru = BoundedLRU(2)
    assert lru.put("a", 1) == [] and lru.put("b", 2) == []
    assert lru.put("a", 3) == []
    assert lru.put("c", 4) == [("b", 2)]
    assert lru.items() == [("a", 3), ("c", 4)]


def test_a_rejected_get_if_leaves_the_order() -> None:
    lru = BoundedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get_if("a", lambda v: v == 0) is None
    assert lru.put("c", 3) == [("a", 1)]


def test_capacity_zero_and_below_keep_nothing() -> None:
    for capacity in (0, -1):
        lru = BoundedLRU(capacity)
        assert lru.put("a", 1) == [("a", 1)]
        assert len(lru) == 0 and lru.oldest() is None and lru.pop_oldest() is None


def test_none_values_are_told_apart_from_absence_by_default() -> None:
    lru = BoundedLRU(2, lock=False)
    lru.put("a", None)
    assert "a" in lru and lru.get("a", 0) is None and lru.get("b", 0) == 0


def test_threads_sharing_a_locked_map_stay_within_capacity() -> None:
    lru: BoundedLRU[int, int] = BoundedLRU(16)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(2000):
                lru.put((i * 7 + offset) % 64, i)
                lru.get((i * 3 + offset) % 64)
                if i % 50 == 0:
                    lru.pop(i % 64)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(lru) <= 16 and len(set(lru.keys())) == len(lru)
