"""Property test: a random workload never breaks the pool's bounds or evicts an in-use/pinned adapter.

Hypothesis drives load / acquire / release / evict / pin / unpin with random ranks (some above
max_rank) and random target sets, against a pool whose byte bound leaves fewer rows than
`max_slots * max_rank`, so both slot pressure and per-kind row pressure occur. A shadow model
(refcounts, pins, ranks per kind) predicts exactly when a load must raise PoolFull. A twin pool
that always takes the full eviction search (no O(1) fast path for the least recently used idle
adapter) gets the same operations and must end every step holding the same adapters.
"""
import torch
from adapter_fakes import make_weights, read_back, tiny_specs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraserve.adapters.pool import AdapterPool, PoolConfig, PoolFull

SPECS = tiny_specs()
KINDS = [s.kind for s in SPECS]
MAX_SLOTS, MAX_RANK, ROWS = 3, 4, 7
KEYS = [(f"t/a{i}", "r1") for i in range(6)]


class SearchingPool(AdapterPool):
    """The pool with its eviction fast path off: every load that needs room searches in full."""

    def _make_room(self, key, plan) -> None:
        self._search_room(key, plan)


class PoolWorkload(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        per_row = AdapterPool(SPECS, PoolConfig(max_slots=1, max_rank=1)).bytes_capacity
        self.pool = AdapterPool(SPECS, PoolConfig(MAX_SLOTS, MAX_RANK, max_bytes=ROWS * per_row + 5))
        self.twin = SearchingPool(SPECS, PoolConfig(MAX_SLOTS, MAX_RANK, max_bytes=ROWS * per_row + 5))
        self.held: list[tuple[tuple[str, str], int]] = []  # (key, slot) per running sequence
        self.pinned: set[tuple[str, str]] = set()
        self.shape: dict[tuple[str, str], tuple[int, set[str]]] = {}  # key -> (rank, kinds)
        self.content: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def _busy(self) -> set[tuple[str, str]]:
        return {k for k, _ in self.held} | self.pinned

    def _must_be_full(self, rank: int, kinds: set[str]) -> bool:
        """True when even evicting every idle adapter leaves no room (the pool must refuse)."""
        busy = [self.shape[k] for k in self._busy()]
        if len(busy) == MAX_SLOTS:
            return True
        return any(ROWS - sum(r for r, ks in busy if kind in ks) < rank for kind in kinds)

    @rule(i=st.integers(0, len(KEYS) - 1), rank=st.integers(1, MAX_RANK + 1),
          kinds=st.sets(st.sampled_from(KINDS), min_size=1), seed=st.integers(0, 2**16))
    def load(self, i, rank, kinds, seed):
        key = KEYS[i]
        weights = make_weights(SPECS, rank, sorted(kinds), seed=seed)
        if key in self.pool:
            assert self.pool.load(key, weights) == self.pool.slot_of(key)
            self.twin.load(key, weights)
            return
        before = set(self.pool.resident())
        if rank > MAX_RANK:
            try:
                self.pool.load(key, weights)
                raise AssertionError("rank above max_rank was accepted")
            except ValueError:
                return
        try:
            self.twin.load(key, weights)
        except PoolFull:
            pass
        try:
            slot = self.pool.load(key, weights)
        except PoolFull:
            assert self._must_be_full(rank, kinds)
            assert set(self.pool.resident()) == before, "a refused load evicted something"
            return
        assert not self._must_be_full(rank, kinds)
        self.shape[key] = (rank, kinds)
        self.content[key] = weights.tensors
        back = read_back(self.pool, slot)
        assert all(torch.equal(back[n], t) for n, t in weights.tensors.items())

    @precondition(lambda self: self.pool.resident())
    @rule(data=st.data())
    def acquire(self, data):
        key = data.draw(st.sampled_from(self.pool.resident()))
        self.held.append((key, self.pool.acquire(key)))
        self.twin.acquire(key)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        key, slot = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.release(slot)
        self.twin.release(self.twin.slot_of(key))

    @rule(i=st.integers(0, len(KEYS) - 1))
    def evict(self, i):
        key = KEYS[i]
        expected = key in self.pool and key not in self._busy()
        assert self.pool.evict(key) == expected
        assert self.twin.evict(key) == expected

    @precondition(lambda self: self.pool.resident())
    @rule(data=st.data(), pin=st.booleans())
    def pin_or_unpin(self, data, pin):
        key = data.draw(st.sampled_from(self.pool.resident()))
        if pin:
            self.pool.pin(key)
            self.twin.pin(key)
            self.pinned.add(key)
        else:
            self.pool.unpin(key)
            self.twin.unpin(key)
            self.pinned.discard(key)

    @invariant()
    def bounds_hold_and_busy_adapters_stay(self):
        self.pool.check_invariants()
        assert sorted(self.pool.resident()) == sorted(self.twin.resident()), "the fast path evicted otherwise"
        stats = self.pool.stats
        assert stats.resident_adapters <= MAX_SLOTS
        assert stats.bytes_used <= stats.bytes_capacity <= self.pool.config.max_bytes
        for key in self._busy():
            assert key in self.pool, f"busy adapter {key} was evicted"
        for key, slot in self.held:
            assert self.pool.slot_of(key) == slot
            back = read_back(self.pool, slot)
            assert all(torch.equal(back[n], t) for n, t in self.content[key].items())


PoolWorkload.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_pool_workload = PoolWorkload.TestCase
