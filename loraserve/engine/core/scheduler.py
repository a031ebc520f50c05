"""Continuous batching with adapter-aware admission and fair share in tokens. Plain Python state
machine, no tensors.

Each step is either a prefill step (admit waiting sequences, up to the token and batch budgets;
a prompt longer than what is left of the token budget is prefilled in chunks over several steps)
or a decode step (one token for every running sequence whose prompt is done). Sequences whose adapter is still paging
in from disk are *parked* outside the waiting queue, so they never block the queue; when their
adapter arrives they rejoin it in arrival order.

Fair share (several tenants with work): each tenant has a virtual time, the tokens computed for
it so far (prefill tokens when scheduled, one per decode token) over its weight. The tenant
furthest behind is served first, within a step and between steps:

- a prefill step fills its token budget in virtual-time order (deficit round robin in tokens:
  each turn goes to the tenant with the least virtual time, its prompts in arrival order, a
  prompt it is prefilling first), and while another tenant has work, or had some in the last
  `decode_run` steps, no tenant takes more than its weighted share of the step's
  `max_batched_tokens`: a long prompt is chunked at that share, so another tenant's short
  requests are admitted in every step, and a client between two requests keeps its share (the
  step in flight when its next request comes is no bigger than the others' share);
- a decode step goes first when a tenant with sequences ready to decode is behind every tenant
  with prompts to prefill, so a light tenant's tokens do not wait behind another's long
  prefills; at most `decode_run` such steps run in a row (by default the steps a full batch
  needs to decode `max_batched_tokens` tokens), then the prompts get a step.

A tenant that was idle starts at the least virtual time of those with work (idling earns no
credit), and no tenant falls more than one step budget behind another (a lag earned long ago
buys no long monopoly). With one tenant, none of this applies: arrival order, prefill first.

Training is work of its tenant in the same virtual time. A tenant with training passes queued
(`train_joined` .. `train_left`) has work as one with requests has (it joins at the floor, keeps
its virtual time, counts in the lag bound), and each training slice charges it the slice's
tokens (`charge`: a token forward counts one, forward and backward three). The engine loop runs
at most one slice between two serving steps, and only in training's turn (`training_turn`): when
the tenant, charged for the slice it would run, is still not ahead of any other tenant with
serving work. So a light tenant's request arriving while others train runs its prefill and its
decode steps before their next slice, until its own tokens have caught up with that slice's;
then slices and its steps alternate in the ratio of their tokens. Against its own serving work
a tenant's training alternates step for step (one slice at most between two of its steps).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque
from typing import Protocol

from .block_manager import BlockManager
from .seq_queue import SeqQueue
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
                 gate: AdapterGate | None = None, starve_s: float = 0.5,
                 decode_run: int | None = None):
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.gate = gate
        self.starve_s = starve_s
        # decode steps that may go ahead of other tenants' prompts in a row: as many as a full
        # batch needs to decode one step budget of tokens
        self.decode_run = decode_run or max(1, math.ceil(max_batched_tokens / max_batch_size))
        # ordered sets: adding, finishing, aborting, admitting and preempting a sequence are
        # O(1) whatever the queues' lengths
        self.waiting = SeqQueue()
        self.running = SeqQueue()
        self.parked: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._chunking = False  # the last prefill step left a prompt half done
        self._vtime: dict[str, float] = {}   # tenant -> tokens computed for it / its weight
        self._weight: dict[str, float] = {}  # tenant -> weight of its latest sequence
        self._active: dict[str, int] = {}    # tenant -> its sequences waiting or running
        self._queued: dict[str, int] = {}    # tenant -> its sequences waiting
        self._decode_run = 0  # decode steps since the last prefill step
        self._steps = 0
        self._recent: dict[str, int] = {}  # tenant -> the last step it had work in
        self._training: dict[str, float] = {}  # tenant -> weight: tenants with training queued
        self.last_kind: str | None = None  # "prefill", "decode" or None (nothing) of the last schedule()

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._joined(seq)
        self._queue(seq, +1)

    def park(self, seq: Sequence) -> None:
        seq.status = SeqStatus.PARKED
        self.parked[seq.request_id] = seq

    def unpark(self, seq: Sequence) -> None:
        """seq's adapter has arrived: rejoin the waiting queue in arrival order."""
        if self.parked.pop(seq.request_id, None) is None:
            return
        seq.status = SeqStatus.WAITING
        self.waiting.insert_by_arrival(seq)
        self._joined(seq)
        self._queue(seq, +1)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free what it holds."""
        queued = self.running.discard(seq)
        if not queued and seq.status is SeqStatus.WAITING and self.waiting.discard(seq):
            self._queue(seq, -1)
            queued = True
        if queued:
            self._left(seq)
        self.parked.pop(seq.request_id, None)
        self.blocks.free(seq)
        self._release_adapter(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def can_decode(self) -> bool:
        """Whether a running sequence is ready for a decode step (its prompt is done)."""
        return any(q.num_pending == 1 for q in self.running)

    def schedule(self, decode_first: bool = False) -> tuple[list[Sequence], bool]:
        """Pick the next batch: (sequences, is_prefill). Empty when nothing can run.

        Prefill goes first, except right after a step that left a prompt half done (chunked
        prefill): then the running sequences decode one token first, so a long prompt costs
        them one chunk of latency at a time, not the whole prompt. With several tenants, also
        when a tenant ready to decode is behind every tenant with prompts (module doc). And
        when the caller asks (`decode_first`: page-ins it just asked for are being read)."""
        fair = self._sharing()
        if fair and self._active:
            self._bound_lag()
        decode_first = (self._chunking or decode_first) and self.can_decode()
        ahead = fair and not decode_first and self._decoder_behind()
        if not (decode_first or ahead):
            batch = self._schedule_prefill_fair() if fair else self._schedule_prefill()
            if batch:
                self._decode_run = 0
                return self._charged(batch, True), True
        batch = self._schedule_decode()
        self._chunking = False
        if batch:
            self._decode_run += 1
            return self._charged(batch, False), False
        batch = self._schedule_prefill_fair() if fair else self._schedule_prefill()
        if batch:  # every running sequence was mid-prefill
            self._decode_run = 0
        return self._charged(batch, True), bool(batch)

    def _schedule_prefill(self) -> list[Sequence]:
        """One tenant: continue prompts already being prefilled, then admit waiting sequences
        in arrival order, within `max_batched_tokens`; the last prompt that does not fit gets
        a chunk of what is left. A sequence that wants prompt logprobs is never chunked (it may
        run alone over budget)."""
        batch: list[Sequence] = []
        budget = self.max_batched_tokens
        for seq in self.running:  # admitted earlier, prompt not done
            if seq.num_pending > 1 and budget > 0:
                seq.num_scheduled = min(seq.num_pending, budget)
                budget -= seq.num_scheduled
                batch.append(seq)
        starving: list[Sequence] = []
        admitted: list[Sequence] = []
        for seq in self.waiting:  # admitted ones leave it after the loop (_start_running)
            if len(self.running) + len(admitted) >= self.max_batch_size or budget <= 0:
                break
            verdict = self._admit(seq, budget, bool(batch), starving)
            if verdict == "stop":
                break
            if verdict == "skip":
                continue
            budget -= seq.num_scheduled
            batch.append(seq)
            admitted.append(seq)
        self._start_running(admitted)
        self._chunking = any(q.num_scheduled < q.num_pending for q in batch)
        return batch

    def _schedule_prefill_fair(self) -> list[Sequence]:
        """Several tenants: the step's token budget in virtual-time order (module doc). Each
        tenant's own candidates keep their order: its prompts being prefilled, then its waiting
        sequences in queue order; a tenant whose turn ends in a chunk (its share or the budget
        ran out) is done for this step."""
        queues: dict[str, deque[Sequence]] = {}
        for seq in self.running:
            if seq.num_pending > 1:
                queues.setdefault(seq.tenant, deque()).append(seq)
        for seq in self.waiting:
            queues.setdefault(seq.tenant, deque()).append(seq)
        if not queues:
            return []
        total = sum(self._weight[t] for t in self._recent)
        share = {t: max(1, int(self.max_batched_tokens * self._weight[t] / total))
                 for t in queues}
        heap = [(self._vtime[t], q[0].arrival, t) for t, q in queues.items()]
        heapq.heapify(heap)
        batch: list[Sequence] = []
        budget = self.max_batched_tokens
        starving: list[Sequence] = []
        admitted: list[Sequence] = []
        full = False
        while heap and budget > 0:
            vt, _, tenant = heapq.heappop(heap)
            q = queues[tenant]
            seq = q.popleft()
            room = min(budget, share[tenant])
            if seq.status is SeqStatus.RUNNING:  # its prompt, a chunk at a time
                seq.num_scheduled = min(seq.num_pending, room)
            else:
                # a tenant's prompts being prefilled come before its waiting sequences, so a
                # tenant that reaches one it cannot admit has nothing more in this step
                if full or len(self.running) + len(admitted) >= self.max_batch_size:
                    full = True  # no more admissions; other tenants' prompts still go on
                    continue
                verdict = self._admit(seq, room, bool(batch), starving)
                if verdict == "stop":  # out of KV blocks: admit nothing more, keep order
                    full = True
                    continue
                if verdict == "later":  # prompt logprobs: it and its tenant's later ones wait
                    continue
                if verdict == "skip":
                    if q:
                        heapq.heappush(heap, (vt, q[0].arrival, tenant))
                    continue
                admitted.append(seq)
            budget -= seq.num_scheduled
            share[tenant] -= seq.num_scheduled
            batch.append(seq)
            vt += seq.num_scheduled / seq.tenant_weight
            if q and seq.num_scheduled == seq.num_pending and share[tenant] > 0:
                heapq.heappush(heap, (vt, q[0].arrival, tenant))
        self._start_running(admitted)
        self._chunking = any(q.num_scheduled < q.num_pending for q in batch)
        return batch

    def _admit(self, seq: Sequence, budget: int, batch_open: bool,
               starving: list[Sequence]) -> str:
        """Try to admit waiting `seq` with `budget` tokens left: "ok" (it is running now, its
        `num_scheduled` set; it leaves the waiting queue when the step's admissions are done),
        "skip" (its adapter has no slot now: try the next one), "later" (it wants prompt
        logprobs and does not fit: a later step) or "stop" (out of KV blocks, or a
        prompt-logprobs sequence keeps arrival order: admit nothing more)."""
        whole = seq.wants_prompt_logprobs
        if whole and len(seq) - seq.num_cached > budget and batch_open:
            return "later" if len(self._active) > 1 else "stop"  # it runs alone later
        if not self.blocks.can_allocate(seq):
            return "stop"  # keep arrival order for memory: later, smaller requests do not jump ahead
        if seq.adapter_key is not None:
            if starving and not self.gate.is_resident(seq.adapter_key):
                return "skip"  # an older request starves for room: admit only resident adapters
            slot = self.gate.try_acquire(seq.adapter_key, seq.adapter_record)
            if slot is None:
                if time.monotonic() - seq.arrival > self.starve_s and not starving:
                    starving.append(seq)
                return "skip"
            seq.slot = slot
        self.blocks.allocate(seq)  # may find a cached prefix and advance num_cached
        self._queue(seq, -1)
        seq.status = SeqStatus.RUNNING
        seq.num_scheduled = seq.num_pending if whole else min(seq.num_pending, budget)
        return "ok"

    def _start_running(self, admitted: list[Sequence]) -> None:
        """The sequences a prefill step admitted leave the waiting queue for the running one."""
        for seq in admitted:
            self.waiting.remove(seq)
        self.running.extend(admitted)

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running or seq.num_pending != 1:
                continue  # preempted below to make room for an older one, or mid-prefill
            while not self.blocks.can_append(seq):
                victim = self.running.last()
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
        self._queue(seq, +1)
        self.num_preemptions += 1

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.slot >= 0 and self.gate is not None:
            self.gate.release(seq.slot)
        seq.slot = -1

    # -- fair share -------------------------------------------------------------------------
    def _joined(self, seq: Sequence) -> None:
        """seq is waiting now: its tenant has work (again). A tenant that had none starts at
        the least virtual time of the tenants with work, or its own if that is later."""
        tenant = seq.tenant
        self._weight[tenant] = seq.tenant_weight
        count = self._active.get(tenant, 0)
        if count == 0 and tenant not in self._training:
            self._start(tenant)
        self._active[tenant] = count + 1

    def _start(self, tenant: str) -> None:
        """`tenant` had no work (serving or training): it starts at the least virtual time of
        the tenants with work, or its own if that is later (idling earns no credit)."""
        floor = min(self._working_vtimes(), default=0.0)
        self._vtime[tenant] = max(self._vtime.get(tenant, floor), floor)

    def _working_vtimes(self) -> list[float]:
        """Virtual times of the tenants with work: requests waiting or running, or training."""
        return [self._vtime[t] for t in {*self._active, *self._training} if t in self._vtime]

    def _queue(self, seq: Sequence, change: int) -> None:
        """Count seq's joining (+1) or leaving (-1) the waiting queue."""
        left = self._queued.get(seq.tenant, 0) + change
        if left > 0:
            self._queued[seq.tenant] = left
        else:
            self._queued.pop(seq.tenant, None)

    def _left(self, seq: Sequence) -> None:
        """seq left the waiting queue and the running list for good."""
        tenant = seq.tenant
        count = self._active.get(tenant, 0) - 1
        if count > 0:
            self._active[tenant] = count
            return
        self._active.pop(tenant, None)
        if tenant not in self._recent:  # it never shared a step (seen by no schedule())
            self._weight.pop(tenant, None)
        if not self._active and not self._training:  # the engine is idle: nobody owes anybody
            self._vtime.clear()

    def _sharing(self) -> bool:
        """Count this step; whether several tenants share it: tenants with work now or in the
        last `decode_run` steps (who keep their shares of the step budget)."""
        self._steps += 1
        for tenant in self._active:
            self._recent[tenant] = self._steps
        if len(self._recent) > len(self._active):
            for tenant, step in list(self._recent.items()):
                if self._steps - step > self.decode_run:
                    del self._recent[tenant]
                    self._weight.pop(tenant, None)
        return len(self._recent) > 1

    def charge(self, tenant: str, tokens: float, weight: float) -> None:
        """Count `tokens` computed for `tenant` outside the batches (a training slice) in its
        virtual time. Nothing while no tenant has work (nobody is owed anything then); a tenant
        without work starts, as a joining one does, at the least virtual time of those with
        work, and keeps the charge when its requests come."""
        if tokens <= 0 or not (self._active or self._training):
            return
        if tenant not in self._active and tenant not in self._training:
            self._start(tenant)
        self._vtime[tenant] += tokens / weight

    # -- training: slices between the steps ---------------------------------------------------
    def train_joined(self, tenant: str, weight: float) -> None:
        """`tenant` has a training pass queued (again): it has work, as with a request."""
        if tenant not in self._training and tenant not in self._active:
            self._start(tenant)
        self._training[tenant] = weight

    def train_left(self, tenant: str) -> None:
        """`tenant` has no training pass left."""
        if self._training.pop(tenant, None) is not None and not self._active and not self._training:
            self._vtime.clear()

    def vtime(self, tenant: str) -> float:
        """`tenant`'s virtual time (tokens computed for it over its weight), 0 when it has none."""
        return self._vtime.get(tenant, 0.0)

    def training_turn(self, tenant: str, tokens: float, weight: float) -> bool:
        """Whether `tenant`'s next training slice of `tokens` goes before the next serving step:
        yes when, charged for it, the tenant is not ahead of any other tenant with serving work
        (its own serving alternates with its training, slice for step). Finish times rather than
        start times: a slice costs hundreds of tokens at once, a decode step one per sequence,
        so a request's tokens that arrived behind a slice catch up with it before the next."""
        others = [t for t in self._active if t != tenant and t in self._vtime]
        if not others:
            return True
        self._bound_lag()
        return self.vtime(tenant) + tokens / weight <= min(self._vtime[t] for t in others)

    def _bound_lag(self) -> None:
        """No tenant with work is more than one step budget of virtual time behind another."""
        working = [t for t in {*self._active, *self._training} if t in self._vtime]
        if not working:
            return
        lead = max(self._vtime[t] for t in working)
        for t in working:
            if self._vtime[t] < lead - self.max_batched_tokens:
                self._vtime[t] = lead - self.max_batched_tokens

    def _decoder_behind(self) -> bool:
        """Whether a decode step goes first: some tenant with sequences ready to decode is
        behind every tenant with a prompt to prefill, and the decode steps that went ahead of
        those prompts in a row are fewer than `decode_run`."""
        if self._decode_run >= self.decode_run:
            return False
        decoding = {s.tenant for s in self.running if s.num_pending == 1}
        if not decoding:
            return False
        prefilling = {s.tenant for s in self.running if s.num_pending > 1}
        prefilling.update(self._queued)
        if not prefilling:
            return False
        return min(self._vtime[t] for t in decoding) < min(self._vtime[t] for t in prefilling)

    def _charged(self, batch: list[Sequence], is_prefill: bool) -> list[Sequence]:
        """Charge each sequence's tenant the tokens this step computes for it."""
        self.last_kind = ("prefill" if is_prefill else "decode") if batch else None
        for seq in batch:
            tokens = seq.num_scheduled if is_prefill else 1
            tenant = seq.tenant
            if tenant in self._vtime:
                self._vtime[tenant] += tokens / seq.tenant_weight
        return batch
