"""Continuous batching with adapter-aware admission. Plain Python state machine, no tensors.

Each step is either a prefill step (admit waiting sequences, up to the token and batch budgets;
a prompt longer than what is left of the token budget is prefilled in chunks over several steps)
or a decode step (one token for every running sequence whose prompt is done). Sequences whose adapter is still paging
in from disk are *parked* outside the waiting queue, so they never block the queue; when their
adapter arrives they rejoin it in arrival order.
"""
from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from .block_manager import BlockManager
from .sequence import SeqStatus, Sequence


AdapterKey = tuple[str, str]


class AdapterGate(Protocol):
    """The device adapter pool as the scheduler sees it (`AdapterManager` in production)."""

    def try_acquire(self, key: AdapterKey, record: object = None) -> int | None:
        """A device slot holding key's adapter, with one more reference on it (loading it if
        there is room); None = not now. `record` says where to page the adapter in from again
        should its weights have left every tier since it was paged in."""

    def is_resident(self, key: AdapterKey) -> bool:
        """Whether key's adapter is in the pool (admitting it would load nothing)."""

    def release(self, slot: int) -> None:
        """Drop one reference on the adapter in slot."""


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_batch_size: int, max_batched_tokens: int,
                 gate: AdapterGate | None = None, starve_s: float = 0.5):
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.gate = gate
        self.starve_s = starve_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._chunking = False  # the last prefill step left a prompt half done
        self._vtime: dict[str, float] = {}  # tenant -> admissions / weight (fair share)

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def park(self, seq: Sequence) -> None:
        seq.status = SeqStatus.PARKED
        self.parked[seq.request_id] = seq

    def unpark(self, seq: Sequence) -> None:
        """seq's adapter has arrived: rejoin the waiting queue in arrival order."""
        if self.parked.pop(seq.request_id, None) is None:
            return
        seq.status = SeqStatus.WAITING
        arrivals = [s.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(arrivals, seq.arrival), seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free what it holds."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.request_id, None)
        self.blocks.free(seq)
        self._release_adapter(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next batch: (sequences, is_prefill). Empty when nothing can run.

        Prefill goes first, except right after a step that left a prompt half done (chunked
        prefill): then the running sequences decode one token first, so a long prompt costs
        them one chunk of latency at a time, not the whole prompt."""
        if not (self._chunking and any(q.num_pending == 1 for q in self.running)):
            batch = self._schedule_prefill()
            if batch:
                return batch, True
        batch = self._schedule_decode()
        self._chunking = False
        if batch:
            return batch, False
        batch = self._schedule_prefill()  # every running sequence was mid-prefill
        return batch, bool(batch)

    def _schedule_prefill(self) -> list[Sequence]:
        """Continue prompts already being prefilled, then admit waiting sequences, within
        `max_batched_tokens`; the last prompt that does not fit gets a chunk of what is left.
        A sequence that wants prompt logprobs is never chunked (it may run alone over budget)."""
        batch: list[Sequence] = []
        budget = self.max_batched_tokens
        for seq in self.running:  # admitted earlier, prompt not done
            if seq.num_pending > 1 and budget > 0:
                seq.num_scheduled = min(seq.num_pending, budget)
                budget -= seq.num_scheduled
                batch.append(seq)
        starving: Sequence | None = None
        admitted: list[Sequence] = []
        for seq in self._admission_order():
            if len(self.running) + len(admitted) >= self.max_batch_size or budget <= 0:
                break
            whole = seq.wants_prompt_logprobs
            if whole and len(seq) - seq.num_cached > budget and batch:
                break  # keep arrival order: it runs alone in a later step
            if not self.blocks.can_allocate(seq):
                break  # keep arrival order for memory: later, smaller requests do not jump ahead
            if seq.adapter_key is not None:
                if starving is not None and not self.gate.is_resident(seq.adapter_key):
                    continue  # an older request starves for room: admit only resident adapters
                slot = self.gate.try_acquire(seq.adapter_key, seq.adapter_record)
                if slot is None:
                    if time.monotonic() - seq.arrival > self.starve_s:
                        starving = starving or seq
                    continue
                seq.slot = slot
            self.blocks.allocate(seq)  # may find a cached prefix and advance num_cached
            self.waiting.remove(seq)
            self._charge(seq)
            seq.status = SeqStatus.RUNNING
            seq.num_scheduled = seq.num_pending if whole else min(seq.num_pending, budget)
            budget -= seq.num_scheduled
            batch.append(seq)
            admitted.append(seq)
        self.running.extend(admitted)
        self._chunking = any(q.num_scheduled < q.num_pending for q in batch)
        return batch

    def _admission_order(self) -> Iterator[Sequence]:
        """Waiting sequences in the order admission considers them.

        One tenant: arrival order (preempted sequences first). Several: fair share by stride
        scheduling. Each tenant's own queue keeps its order; the next candidate comes from the
        tenant with the least service so far (admissions / weight, its virtual time), so a tenant
        with thousands queued delays another's request by at most one round. A tenant that was
        idle starts at the least virtual time of those waiting: idling earns no credit.
        """
        queues: dict[str, deque[Sequence]] = {}
        for seq in self.waiting:
            queues.setdefault(seq.tenant, deque()).append(seq)
        if len(queues) <= 1:
            self._vtime = {t: v for t, v in self._vtime.items() if t in queues}
            yield from list(self.waiting)
            return
        known = [self._vtime[t] for t in queues if t in self._vtime]
        floor = min(known, default=0.0)
        self._vtime = {t: max(self._vtime.get(t, floor), floor) for t in queues}
        heap = [(self._vtime[t], q[0].arrival, t) for t, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            vt, _, tenant = heapq.heappop(heap)
            q = queues[tenant]
            seq = q.popleft()
            yield seq
            if q:
                heapq.heappush(heap, (vt + 1.0 / seq.tenant_weight, q[0].arrival, tenant))

    def _charge(self, seq: Sequence) -> None:
        """seq was admitted: its tenant has had one more turn."""
        if seq.tenant in self._vtime:
            self._vtime[seq.tenant] += 1.0 / seq.tenant_weight

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running or seq.num_pending != 1:
                continue  # preempted below to make room for an older one, or mid-prefill
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.allocate(seq)
                batch.append(seq)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV, put it at the head of the queue."""
        self.running.remove(seq)
        self.blocks.free(seq)
        self._release_adapter(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.slot >= 0 and self.gate is not None:
            self.gate.release(seq.slot)
        seq.slot = -1
