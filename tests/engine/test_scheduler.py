"""Scheduler unit tests: a fake adapter gate, a real BlockManager, no model and no tensors.

`_step` plays the engine's part after `schedule()`: the scheduled tokens land in the KV cache, a
sequence whose prompt is done gets one output token, and a finished one is removed."""
from __future__ import annotations

import itertools
import time

from loraserve.engine.core.block_manager import BlockManager
from loraserve.engine.core.scheduler import Scheduler
from loraserve.engine.core.sequence import SeqStatus, Sequence
from loraserve.engine.types import SamplingParams

_PROMPTS = itertools.count(1)
A, B, C, D = ("t/a", "r1"), ("t/b", "r1"), ("t/c", "r1"), ("t/d", "r1")


class FakeGate:
    """`slots` device slots, per-slot reference counts, refused keys, a call log; when a key is
    not resident it takes a never-used slot, else evicts the first unreferenced resident key."""

    def __init__(self, slots: int, refuse=()):
        self.key_of: dict[int, tuple] = {}   # slot -> resident key
        self.refs = [0] * slots
        self.refuse = set(refuse)
        self.log: list[tuple] = []
        self.acquired = 0

    def _slot(self, key):
        return next((s for s, k in self.key_of.items() if k == key), None)

    def try_acquire(self, key, record=None):
        self.log.append(("acquire", key))
        if key in self.refuse:
            return None
        slot = self._slot(key)
        if slot is None:
            empty = [s for s in range(len(self.refs)) if s not in self.key_of]
            idle = [s for s in self.key_of if self.refs[s] == 0]
            if not empty and not idle:
                return None
            slot = (empty or idle)[0]
            self.key_of[slot] = key
        self.refs[slot] += 1
        self.acquired += 1
        return slot

    def is_resident(self, key):
        return self._slot(key) is not None

    def release(self, slot):
        assert self.refs[slot] > 0, f"release of unreferenced slot {slot}"
        self.refs[slot] -= 1
        self.log.append(("release", slot))

    def calls(self, kind):
        return [arg for k, arg in self.log if k == kind]


def _seq(rid, n, adapter=None, arrival=None, max_tokens=4, **params) -> Sequence:
    base = 1000 * next(_PROMPTS)  # distinct prompts: no prefix-cache hits between sequences
    seq = Sequence(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                   ignore_eos=True, **params), adapter_key=adapter)
    if arrival is not None:
        seq.arrival = arrival
    return seq


def _sched(num_blocks=64, block_size=4, gate=None, **kw) -> Scheduler:
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_batched_tokens", 64)
    return Scheduler(BlockManager(num_blocks, block_size), gate=gate or FakeGate(8), **kw)


def _step(sched: Scheduler):
    batch, is_prefill = sched.schedule()
    for seq in batch:
        seq.num_cached = seq.num_cached + seq.num_scheduled if is_prefill else len(seq)
    sched.blocks.commit(batch)
    for seq in batch:
        if seq.num_pending == 0:
            if seq.params.prompt_logprobs is not None:
                seq.prompt_logprobs = []
            seq.output_ids.append(7)
            if len(seq.output_ids) >= seq.params.max_tokens:
                sched.remove(seq)
    return ("prefill" if is_prefill else "decode", [s.request_id for s in batch])


def _ids(seqs):
    return [s.request_id for s in seqs]


def _assert_balanced(sched: Scheduler, gate: FakeGate, live=()):
    live = list(live)
    sched.blocks.check_invariants(live)
    held = sum(1 for s in live if s.slot >= 0)
    assert sum(gate.refs) == held and gate.acquired == len(gate.calls("release")) + held


# -- starvation ---------------------------------------------------------------------------------
def _starvation_setup(starve_s):
    gate = FakeGate(3, refuse={B})           # B's adapter cannot get a slot now
    sched = _sched(gate=gate, starve_s=starve_s)
    old = time.monotonic() - 10.0
    runner = _seq("r0", 4, A, arrival=old - 1)
    sched.add(runner)
    assert _step(sched) == ("prefill", ["r0"])  # A is now resident (and referenced)
    starver, fresh, resident, base = (_seq("s0", 4, B, arrival=old), _seq("s1", 4, C, arrival=old + 1),
                                      _seq("s2", 4, A, arrival=old + 2), _seq("s3", 4, None, arrival=old + 3))
    for s in (starver, fresh, resident, base):
        sched.add(s)
    gate.log.clear()
    return sched, gate, starver, fresh, resident, base


def test_starving_adapter_blocks_only_non_resident_later_adapters():
    sched, gate, starver, fresh, resident, base = _starvation_setup(starve_s=0.5)
    batch, is_prefill = sched.schedule()
    assert is_prefill and _ids(batch) == ["s2", "s3"]   # resident adapter and base model still run
    assert list(sched.waiting) == [starver, fresh]
    assert gate.calls("acquire") == [B, A]              # C was not even tried: it would take B's room
    assert not gate.is_resident(C) and fresh.slot == -1 and resident.slot == 0


def test_before_starve_s_later_non_resident_adapters_are_admitted():
    sched, gate, starver, fresh, resident, base = _starvation_setup(starve_s=1000.0)
    batch, _ = sched.schedule()
    assert _ids(batch) == ["s1", "s2", "s3"]
    assert list(sched.waiting) == [starver] and gate.calls("acquire") == [B, C, A]
    assert gate.is_resident(C) and fresh.slot >= 0


# -- parking ------------------------------------------------------------------------------------
def test_unpark_rejoins_waiting_queue_in_arrival_order():
    sched = _sched()
    seqs = [_seq(f"q{i}", 4, A, arrival=100.0 + i) for i in range(7)]
    sched.add(seqs[1])
    sched.add(seqs[4])
    for i in (0, 2, 3, 5, 6):
        sched.park(seqs[i])
    assert seqs[2].status is SeqStatus.PARKED and len(sched.waiting) == 2
    for i in (5, 2, 6, 0, 3):
        sched.unpark(seqs[i])
    assert list(sched.waiting) == seqs and not sched.parked
    assert all(s.status is SeqStatus.WAITING for s in seqs)
    sched.unpark(seqs[3])                                 # no longer parked
    sched.unpark(_seq("never", 4, A, arrival=103.5))      # never parked
    assert list(sched.waiting) == seqs


# -- budgets ------------------------------------------------------------------------------------
def test_max_batch_size_caps_running_plus_admitted():
    sched = _sched(max_batch_size=3)
    seqs = [_seq(f"q{i}", 4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    assert _step(sched) == ("prefill", ["q0", "q1", "q2"])
    sched.remove(seqs[1])
    assert _step(sched) == ("prefill", ["q3"])            # 2 running + 1 admitted
    assert _ids(sched.running) == ["q0", "q2", "q3"] and list(sched.waiting) == [seqs[4]]


def test_token_budget_chunks_the_last_admitted_prompt():
    sched = _sched(max_batched_tokens=16)
    seqs = [_seq("q0", 6), _seq("q1", 6), _seq("q2", 10), _seq("q3", 2)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == seqs[:3]
    assert [s.num_scheduled for s in batch] == [6, 6, 4]
    assert seqs[2].num_scheduled < seqs[2].num_pending == 10
    assert list(sched.waiting) == [seqs[3]]


def test_prompt_logprobs_are_never_chunked_and_run_alone():
    sched = _sched(max_batched_tokens=16)
    small, echo, after = _seq("q0", 6), _seq("p1", 40, prompt_logprobs=0), _seq("q2", 3)
    for s in (small, echo, after):
        sched.add(s)
    assert _step(sched) == ("prefill", ["q0"])            # echo does not fit what is left: wait
    assert list(sched.waiting) == [echo, after]           # and `after` does not jump ahead
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == [echo] and echo.num_scheduled == 40 == echo.num_pending
    assert list(sched.waiting) == [after]


def test_kv_memory_stops_admission_in_arrival_order():
    gate = FakeGate(4)
    sched = _sched(num_blocks=6, block_size=4, gate=gate)
    first, big, small = _seq("q0", 12, A), _seq("q1", 16, B), _seq("q2", 4, C)
    for s in (first, big, small):
        sched.add(s)
    batch, _ = sched.schedule()
    assert batch == [first] and sched.blocks.num_free == 3
    assert list(sched.waiting) == [big, small]            # small would fit but does not jump ahead
    assert gate.calls("acquire") == [A]


# -- preemption ---------------------------------------------------------------------------------
def test_decode_preempts_most_recently_admitted_and_releases_once():
    gate = FakeGate(4)
    sched = _sched(num_blocks=4, block_size=4, gate=gate)
    a, b, c = _seq("q0", 4, A, max_tokens=6), _seq("q1", 4, B, max_tokens=6), _seq("q2", 4, C, max_tokens=6)
    for s in (a, b, c):
        sched.add(s)
    assert _step(sched) == ("prefill", ["q0", "q1", "q2"])  # one block each, one left
    late = _seq("q3", 8, D)                                 # needs 2 blocks: cannot be admitted
    sched.add(late)
    c_slot = c.slot
    assert _step(sched) == ("decode", ["q0", "q1"])         # b's new block comes from preempting c
    assert sched.num_preemptions == 1 and _ids(sched.running) == ["q0", "q1"]
    assert list(sched.waiting) == [c, late]                 # head of the queue
    assert c.status is SeqStatus.WAITING and c.block_table == [] and c.num_cached == 0 and c.slot == -1
    assert gate.calls("release") == [c_slot] and len(c) == 5  # its output is kept for recompute
    _assert_balanced(sched, gate, [a, b, c, late])
    for _ in range(100):
        if not sched.has_work:
            break
        _step(sched)
    assert not sched.has_work and all(s.is_finished and len(s.output_ids) == 6 for s in (a, b, c))
    assert sched.num_preemptions >= 1 and gate.acquired == 4 + sched.num_preemptions
    _assert_balanced(sched, gate)
    assert sched.blocks.num_free == 4


# -- remove -------------------------------------------------------------------------------------
def test_remove_from_running_waiting_and_parked_frees_everything():
    gate = FakeGate(2, refuse={C})
    sched = _sched(num_blocks=8, gate=gate)
    run, wait, parked = _seq("q0", 6, A), _seq("q1", 4, C), _seq("q2", 4, B)
    sched.add(run)
    sched.add(wait)
    sched.park(parked)
    _step(sched)
    assert list(sched.running) == [run] and list(sched.waiting) == [wait] and run.slot >= 0
    slot = run.slot
    sched.remove(run)
    assert run.is_finished and not sched.running and run.block_table == [] and run.slot == -1
    assert gate.calls("release") == [slot] and sched.blocks.num_free == 8
    sched.remove(run)                                     # twice: nothing more to release
    sched.remove(wait)
    sched.remove(parked)
    assert not sched.waiting and not sched.parked and wait.is_finished and parked.is_finished
    assert gate.calls("release") == [slot] and not sched.has_work
    _assert_balanced(sched, gate)


# -- chunked prefill interleaves with decode ----------------------------------------------------
def test_running_sequences_decode_between_prefill_chunks():
    sched = _sched(max_batched_tokens=8)
    short = _seq("s0", 4, A, max_tokens=10)
    sched.add(short)
    assert _step(sched) == ("prefill", ["s0"])
    long = _seq("l1", 20, B, max_tokens=10)
    sched.add(long)
    steps = [_step(sched) for _ in range(6)]
    assert steps == [("prefill", ["l1"]), ("decode", ["s0"]),
                     ("prefill", ["l1"]), ("decode", ["s0"]),
                     ("prefill", ["l1"]),                  # the last 4 tokens: prompt done
                     ("decode", ["s0", "l1"])]
    assert long.num_cached == 21 and len(long.output_ids) == 2 and len(short.output_ids) == 4


def test_several_preemptions_requeue_in_admission_order_at_the_head():
    gate = FakeGate(4)
    sched = _sched(num_blocks=4, block_size=4, gate=gate)
    seqs = [_seq(f"q{i}", 4, key) for i, key in enumerate((A, B, C, D))]
    for s in seqs:
        sched.add(s)
    assert _step(sched) == ("prefill", ["q0", "q1", "q2", "q3"])  # every block taken
    later = _seq("q9", 12, A)
    sched.add(later)
    assert _step(sched) == ("decode", ["q0", "q1"])      # q3 then q2 make room for q0 and q1
    assert sched.num_preemptions == 2 and list(sched.waiting) == [seqs[2], seqs[3], later]
    assert gate.calls("release") == [3, 2]               # q3 (admitted last) first
    _assert_balanced(sched, gate, seqs + [later])
