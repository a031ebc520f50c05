"""The device-side adapter pool: a bounded working set of adapters in the kernels' rank-row layout.

Layout (docs/INTERNALS.md §2): per target kind `k` and layer `l`, `A_rows[k][l]` `[P, H_in]` and
`B_rows[k][l]` `[P, H_out]` (`B` transposed; MoE kinds `[P, E, H_in]` / `[P, E, H_out]`). An
adapter in slot `a` with rank `r` owns `r` rows of each kind it targets, anywhere in the pool:
`row_table[k][a, i]` is the row of rank index `i < ranks[k][a]`; `ranks[k][a] = 0` means no LoRA
on `k`. Rows are shared across layers. Each kind has its own free list, so an adapter costs exactly
its rank in the kinds it targets.

Residency: an adapter is pinned by refcount while sequences use it (`acquire`/`release`) and by
`pin` while the operator wants it kept. To make room, `load` evicts the least recently used
adapters that are neither in use nor pinned; it never evicts an in-use or pinned adapter.

Ownership: the pool belongs to the engine thread (no locks). Other threads read the pool's
residency and stats from the engine's published snapshot, never from the pool.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from loraserve.adapters.invariants import check_pool
from loraserve.adapters.limits import PoolLimits
from loraserve.adapters.slabs import SlabWeights
from loraserve.adapters.stats import PoolStats
from loraserve.adapters.targets import TargetSpec, TensorSlot, tensor_index, tensor_names
from loraserve.adapters.weights import AdapterKey, LoadPlan, plan_load

__all__ = ["AdapterPool", "PoolConfig", "PoolFull", "TargetSpec", "tensor_names"]


class PoolFull(RuntimeError):
    """The adapter cannot be placed now: in-use or pinned adapters hold the slots/rows it needs."""


@dataclass(slots=True)
class PoolConfig:
    """Bounds of the device pool.

    `max_slots` adapters at most. Rows per kind `P`: with `max_bytes`, as many as fit in it (one rank
    row across all kinds and layers at a time, capped at `max_slots * max_rank`), so the
    preallocated pool is <= `max_bytes`; without, `max_slots * max_rank`.
    """

    max_slots: int
    max_rank: int = 64
    max_bytes: int | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {self.max_rank}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 when given, got {self.max_bytes}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"pool dtype must be a floating dtype, got {self.dtype}")


@dataclass(slots=True, frozen=True)
class ResidentView:
    """A resident adapter as callers may see it (a copy: changing it changes nothing)."""

    slot: int
    rank: int
    refcount: int  # running sequences using it
    pinned: bool


@dataclass(slots=True)
class _Resident:
    slot: int
    rank: int
    rows: dict[str, list[int]]  # kind -> the pool rows of rank indices 0..rank-1
    nbytes: int
    refcount: int = 0
    pinned: bool = False


class AdapterPool:
    """Bounded, refcount-pinned, LRU-evicting pool of adapters in rank-row layout (see module doc)."""

    def __init__(self, targets: list[TargetSpec], config: PoolConfig):
        if not targets:
            raise ValueError("the pool needs at least one LoRA target kind")
        kinds = [t.kind for t in targets]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"duplicate target kinds in {kinds}")
        self.config = config
        self.specs: dict[str, TargetSpec] = {t.kind: t for t in targets}
        self._index: dict[str, TensorSlot] = tensor_index(targets)
        itemsize = torch.empty((), dtype=config.dtype).element_size()
        self.row_bytes: dict[str, int] = {t.kind: t.row_elems * len(t.layers) * itemsize for t in targets}
        self.rows_per_kind = self._rows_per_kind(sum(self.row_bytes.values()))
        self._allocate(config.device)
        self._entries: OrderedDict[AdapterKey, _Resident] = OrderedDict()  # LRU first
        self._slot_keys: list[AdapterKey | None] = [None] * config.max_slots
        self._free_slots = list(range(config.max_slots - 1, -1, -1))  # pop() -> lowest
        self._free_rows = {k: list(range(self.rows_per_kind - 1, -1, -1)) for k in self.specs}
        self._stats = PoolStats(max_slots=config.max_slots, bytes_capacity=self.bytes_capacity)
        self.version = 0  # bumped whenever row tables or rows change (load, eviction)

    def _rows_per_kind(self, bytes_per_row: int) -> int:
        cfg = self.config
        full = cfg.max_slots * cfg.max_rank
        if cfg.max_bytes is None:
            return full
        rows = min(full, cfg.max_bytes // bytes_per_row)
        if rows < 1:
            raise ValueError(f"max_bytes={cfg.max_bytes} is below one rank row of the pool ({bytes_per_row} bytes)")
        return rows

    def _allocate(self, device: str) -> None:
        cfg, p = self.config, self.rows_per_kind
        self.A_rows: dict[str, dict[int, torch.Tensor]] = {}  # kind -> layer -> [P, H_in] | [P, E, H_in]
        self.B_rows: dict[str, dict[int, torch.Tensor]] = {}  # kind -> layer -> [P, H_out] | [P, E, H_out]
        self.row_table: dict[str, torch.Tensor] = {}  # kind -> [A, R_max] int32
        self.ranks: dict[str, torch.Tensor] = {}  # kind -> [A] int32, 0 = no LoRA on kind
        # one tensor per kind and side, [layers, P, ...]; the per-layer tensors the kernels read
        # are views of it, so a page-in writes every layer of a kind in one copy (`_copy_in`)
        self._on_cpu = torch.device(device).type == "cpu"
        self._A_all: dict[str, torch.Tensor] = {}
        self._B_all: dict[str, torch.Tensor] = {}
        for kind, s in self.specs.items():
            plane = (s.experts,) if s.experts else ()
            a_all = torch.zeros(len(s.layers), p, *plane, s.h_in, dtype=cfg.dtype, device=device)
            b_all = torch.zeros(len(s.layers), p, *plane, s.h_out, dtype=cfg.dtype, device=device)
            self._A_all[kind], self._B_all[kind] = a_all, b_all
            self.A_rows[kind] = {l: a_all[i] for i, l in enumerate(s.layers)}
            self.B_rows[kind] = {l: b_all[i] for i, l in enumerate(s.layers)}
            self.row_table[kind] = torch.zeros(cfg.max_slots, cfg.max_rank, dtype=torch.int32, device=device)
            self.ranks[kind] = torch.zeros(cfg.max_slots, dtype=torch.int32, device=device)
        # on the CPU the bookkeeping is written through numpy views of the same memory: a write
        # there costs ~0.3 us, a torch index-assign ~3-5 us, and a page-in makes several
        self._table_np = {k: t.numpy() for k, t in self.row_table.items()} if self._on_cpu else {}
        # on the CPU a slab load copies through numpy views of the rows' bits (`_copy_slab_raw`)
        self._A_raw = {k: _raw(t) for k, t in self._A_all.items()} if self._on_cpu else {}
        self._B_raw = {k: _raw(t) for k, t in self._B_all.items()} if self._on_cpu else {}
        # CUDA: slab loads copy on a side stream (`_side_stream`); (event, entry) of copies in flight
        on_cuda = torch.device(device).type == "cuda"
        self._copy_stream = torch.cuda.Stream(torch.device(device)) if on_cuda else None
        self._in_copy: list = []
        self.copies_queued = 0
        self._ranks_np = {k: t.numpy() for k, t in self.ranks.items()} if self._on_cpu else {}

    @property
    def bytes_capacity(self) -> int:
        """Bytes of the preallocated row pools (row tables not counted)."""
        return self.rows_per_kind * sum(self.row_bytes.values())

    # ---- lookups -------------------------------------------------------------------------------

    def slot_of(self, key: AdapterKey) -> int | None:
        """Slot of a resident adapter (and a hit), or None (and a miss)."""
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._entries.move_to_end(key)
        return entry.slot

    def __contains__(self, key: AdapterKey) -> bool:
        return key in self._entries


    def has_kind(self, slot: int, kind: str) -> bool:
        """Whether the adapter in `slot` has LoRA on target `kind` (host-side, no device read)."""
        key = self._slot_keys[slot]
        entry = self._entries.get(key) if key is not None else None
        return entry is not None and kind in entry.rows

    def entry(self, key: AdapterKey) -> ResidentView | None:
        """A copy of key's residency (slot, rank, refcount, pinned), or None when not resident."""
        e = self._entries.get(key)
        return ResidentView(e.slot, e.rank, e.refcount, e.pinned) if e is not None else None

    def resident(self) -> list[AdapterKey]:
        """Resident adapters, least recently used first."""
        return list(self._entries)


    @property
    def stats(self) -> PoolStats:
        """A snapshot of the counters and gauges."""
        s = self._stats
        s.resident_adapters = len(self._entries)
        s.pinned_adapters = sum(e.pinned for e in self._entries.values())
        s.in_use_adapters = sum(e.refcount > 0 for e in self._entries.values())
        s.bytes_used = sum(e.nbytes for e in self._entries.values())
        return s.copy()

    # ---- refcount and pins ---------------------------------------------------------------------

    def acquire(self, key: AdapterKey) -> int:
        """Mark `key` in use by one more sequence (it cannot be evicted); returns its slot."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"adapter {key} is not resident in the pool; load it first")
        entry.refcount += 1
        self._entries.move_to_end(key)
        return entry.slot

    def release(self, slot: int) -> None:
        """One sequence stopped using the adapter in `slot`."""
        key = self._slot_keys[slot] if 0 <= slot < len(self._slot_keys) else None
        entry = self._entries.get(key) if key is not None else None
        if entry is None or entry.refcount == 0:
            raise ValueError(f"release of slot {slot}, which holds no acquired adapter")
        entry.refcount -= 1
        self._entries.move_to_end(key)

    def pin(self, key: AdapterKey) -> None:
        """Keep resident `key` until `unpin` (it must be resident)."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"cannot pin adapter {key}: not resident in the pool; load it first")
        entry.pinned = True

    def unpin(self, key: AdapterKey) -> None:
        """Make `key` evictable again (no-op when not resident)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.pinned = False

    def is_pinned(self, key: AdapterKey) -> bool:
        entry = self._entries.get(key)
        return bool(entry and entry.pinned)

    # ---- load / evict --------------------------------------------------------------------------

    def load(self, key: AdapterKey, weights) -> int:
        """Copy `weights` (an `AdapterWeights`) into free rows of a free slot; returns the slot.

        Already resident -> its slot. Evicts LRU adapters that are neither in use nor pinned as
        needed. Raises PoolFull when in-use/pinned adapters leave no room now, ValueError when it can
        never fit (rank > max_rank or > rows per kind, or a tensor the pool's base lacks).
        """
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry.slot
        slab = isinstance(weights, SlabWeights)
        plan = weights if slab else self._plan(weights)  # a slab entry was checked when it was made
        self._make_room(key, plan)
        slot = self._free_slots.pop()
        rows = {k: [self._free_rows[k].pop() for _ in range(plan.rank)] for k in plan.kinds}
        if slab:
            self._copy_slab(slot, rows, weights)
        else:
            self._copy_in(slot, rows, plan)
        nbytes = sum(plan.rank * self.row_bytes[k] for k in plan.kinds)
        self._entries[key] = _Resident(slot, plan.rank, rows, nbytes)
        self._slot_keys[slot] = key
        self._stats.loads += 1
        return slot

    @property
    def limits(self) -> PoolLimits:
        return PoolLimits(min(self.config.max_rank, self.rows_per_kind), tuple(self.specs))

    def check_admissible(self, rank: int, targets: list[str]) -> None:
        """See `PoolLimits.check_admissible`."""
        self.limits.check_admissible(rank, targets)

    def evict(self, key: AdapterKey) -> bool:
        """Drop `key` if resident, unused and unpinned; returns whether it was dropped."""
        entry = self._entries.get(key)
        if entry is None or entry.refcount > 0 or entry.pinned:
            return False
        self._drop(key, entry)
        return True

    def _plan(self, weights) -> LoadPlan:
        return plan_load(weights, self.specs, self._index, self.config.max_rank, self.rows_per_kind)

    def _shortfall(self, plan: LoadPlan) -> str | None:
        """None when evicting idle adapters can make room for `plan`, else why it cannot."""
        need_slot = not self._free_slots
        short = {k: plan.rank - len(self._free_rows[k]) for k in plan.kinds}
        idle = [e for e in self._entries.values() if e.refcount == 0 and not e.pinned]
        if need_slot and not idle:
            return f"all {self.config.max_slots} slots hold in-use or pinned adapters"
        for kind, missing in short.items():
            freeable = sum(e.rank for e in idle if kind in e.rows)
            if missing > freeable:
                return (f"needs {plan.rank} {kind} rows, {len(self._free_rows[kind])} free and "
                        f"{freeable} held by idle adapters; the rest are in use or pinned")
        return None

    def _make_room(self, key: AdapterKey, plan: LoadPlan) -> None:
        if self._free_slots and all(len(self._free_rows[k]) >= plan.rank for k in plan.kinds):
            return
        # the usual miss at namespace scale: the least recently used idle adapter alone makes
        # room; dropping it is what the full search below would do first (O(1), not O(slots))
        for victim, entry in self._entries.items():
            if entry.refcount or entry.pinned:
                continue
            if all(len(self._free_rows[k]) + (entry.rank if k in entry.rows else 0) >= plan.rank
                   for k in plan.kinds):
                self._drop(victim, entry)
                return
            break
        self._search_room(key, plan)

    def _search_room(self, key: AdapterKey, plan: LoadPlan) -> None:
        """Evict idle adapters, least recently used first, that free what `plan` lacks; PoolFull
        (evicting nothing) when even all of them would not do."""
        reason = self._shortfall(plan)
        if reason is not None:
            raise PoolFull(f"adapter pool full, cannot load {key} (rank {plan.rank}) now: {reason}")
        for victim, entry in list(self._entries.items()):  # LRU first
            need_slot = not self._free_slots
            short = {k for k in plan.kinds if len(self._free_rows[k]) < plan.rank}
            if not need_slot and not short:
                return
            if entry.refcount or entry.pinned:
                continue
            if need_slot or short & entry.rows.keys():
                self._drop(victim, entry)

    def _drop(self, key: AdapterKey, entry: _Resident) -> None:
        del self._entries[key]
        self.version += 1
        self._slot_keys[entry.slot] = None
        self._free_slots.append(entry.slot)
        for kind, rows in entry.rows.items():
            self._free_rows[kind].extend(reversed(rows))
            self._set_rows(kind, entry.slot, [])
        self._stats.evictions += 1

    def _copy_in(self, slot: int, rows: dict[str, list[int]], plan: LoadPlan) -> None:
        """Per kind, the adapter's layers stacked into the pool's row layout and written with one
        copy per side (a 28-layer base: 2 copies per kind, not 56); when it skips a layer of a
        kind, that kind goes layer by layer and the skipped layers get zero rows."""
        dev, dtype = self.config.device, self.config.dtype
        self.version += 1
        for kind, kind_rows in rows.items():
            lo = kind_rows[0]
            contiguous = kind_rows == list(range(lo, lo + len(kind_rows)))  # the usual case
            idx = None if contiguous and self._on_cpu else torch.tensor(kind_rows, dtype=torch.int64, device=dev)
            moe = self.specs[kind].experts > 0
            layers = self.specs[kind].layers
            pairs = [plan.tensors.get((kind, layer)) for layer in layers]
            # [r, in] / [out, r] -> rows [r, in] / [r, out]; MoE [E, r, in] / [E, out, r] -> [r, E, ...]
            a_rows = [None if p is None else (p[0].transpose(0, 1) if moe else p[0]) for p in pairs]
            b_rows = [None if p is None else (p[1].permute(2, 0, 1) if moe else p[1].t()) for p in pairs]
            if all(a is not None for a in a_rows):
                a_all, b_all = self._stacked(a_rows), self._stacked(b_rows)  # [L, r, (E,) in|out]
                if contiguous:  # a plain slice copy, ~3x index_copy_'s speed
                    self._A_all[kind][:, lo:lo + len(kind_rows)].copy_(a_all)
                    self._B_all[kind][:, lo:lo + len(kind_rows)].copy_(b_all)
                else:
                    self._A_all[kind].index_copy_(1, idx, a_all)
                    self._B_all[kind].index_copy_(1, idx, b_all)
            else:
                if idx is None:
                    idx = torch.tensor(kind_rows, dtype=torch.int64, device=dev)
                for layer, a, b in zip(layers, a_rows, b_rows):
                    A, B = self.A_rows[kind][layer], self.B_rows[kind][layer]
                    if a is None:
                        A.index_fill_(0, idx, 0)
                        B.index_fill_(0, idx, 0)
                    else:
                        A.index_copy_(0, idx, a.to(dev, dtype, non_blocking=True))
                        B.index_copy_(0, idx, b.to(dev, dtype, non_blocking=True))
            self._set_rows(kind, slot, kind_rows, idx)

    def _copy_slab(self, slot: int, rows: dict[str, list[int]], weights: SlabWeights) -> None:
        """A slab entry is already in the row layout (`slabs`): one copy per kind and side, a
        slice when the rows are contiguous (the usual case). Off the CPU the copies run on the
        pool's side stream from pinned memory (`_side_stream`)."""
        self.version += 1
        if self._A_raw:
            self._copy_slab_raw(slot, rows, weights)
            return
        dev = self.config.device
        with self._side_stream(weights):
            for kind, a, b in weights.parts():
                kind_rows = rows[kind]
                lo = kind_rows[0]
                idx = None
                if kind_rows == list(range(lo, lo + len(kind_rows))):
                    self._A_all[kind][:, lo:lo + len(kind_rows)].copy_(a, non_blocking=True)
                    self._B_all[kind][:, lo:lo + len(kind_rows)].copy_(b, non_blocking=True)
                else:
                    idx = torch.tensor(kind_rows, dtype=torch.int64, device=dev)
                    self._A_all[kind].index_copy_(1, idx, a.to(dev, non_blocking=True))
                    self._B_all[kind].index_copy_(1, idx, b.to(dev, non_blocking=True))
                if idx is None and not self._on_cpu:
                    idx = torch.tensor(kind_rows, dtype=torch.int64, device=dev)
                self._set_rows(kind, slot, kind_rows, idx)

    def _copy_slab_raw(self, slot: int, rows: dict[str, list[int]], weights: SlabWeights) -> None:
        """`_copy_slab` on the CPU: numpy assignments between views of the same bits."""
        for kind, a, b in weights.raw_parts():
            kind_rows = rows[kind]
            lo = kind_rows[0]
            if kind_rows == list(range(lo, lo + len(kind_rows))):
                self._A_raw[kind][:, lo:lo + len(kind_rows)] = a
                self._B_raw[kind][:, lo:lo + len(kind_rows)] = b
            else:
                self._A_raw[kind][:, kind_rows] = a
                self._B_raw[kind][:, kind_rows] = b
            self._set_rows(kind, slot, kind_rows)

    @contextlib.contextmanager
    def _side_stream(self, weights: SlabWeights):
        """CUDA: the host-to-device copies of a load go on a side stream and the compute stream
        waits for them (an event) before its next kernel: the host never blocks, and the DMA
        runs beside whatever the compute stream is still running. The copy does not wait for
        that work: the rows it writes are free or were an evicted adapter's, and an evicted
        adapter is idle (no sequence holds it, and the step that last read it has been read
        back to the host). The slab slot the copy reads stays referenced until its event has
        passed (`_in_copy`), so a page-in cannot reuse it under the DMA. On the CPU: the plain
        copies, nothing else."""
        if self._copy_stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.config.device)
        self._in_copy = [(e, w) for e, w in self._in_copy if not e.query()]
        with torch.cuda.stream(self._copy_stream):
            yield
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        compute.wait_event(done)
        self._in_copy.append((done, weights))
        self.copies_queued += 1

    def _set_rows(self, kind: str, slot: int, rows: list[int], idx: torch.Tensor | None = None) -> None:
        """Slot `slot` owns `rows` of `kind` (none: it holds no LoRA there). On the CPU through the
        numpy views; elsewhere `idx` is `rows` as a device tensor when there are any."""
        if self._on_cpu:
            self._table_np[kind][slot] = 0
            self._table_np[kind][slot, : len(rows)] = rows
            self._ranks_np[kind][slot] = len(rows)
        else:
            self.row_table[kind][slot].zero_()
            if rows:
                self.row_table[kind][slot, : len(rows)] = idx.to(torch.int32)
            self.ranks[kind][slot] = len(rows)

    def _stacked(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """parts stacked on the pool's device, in its dtype. Off the CPU each goes over first:
        from the pinned CPU cache those copies stay asynchronous, a stacked host copy would not."""
        dev, dtype = self.config.device, self.config.dtype
        if self._on_cpu:
            stacked = torch.stack(parts)
            return stacked if stacked.dtype == dtype else stacked.to(dtype)
        return torch.stack([p.to(dev, dtype, non_blocking=True) for p in parts])

    # ---- testing aid ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests): bounds, free lists, row ownership."""
        check_pool(self, self._entries, self._slot_keys, self._free_slots, self._free_rows)


def _raw(t: torch.Tensor):
    """A numpy view of a CPU tensor's bits, as integers of its element size (any float dtype)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(bits).numpy()
