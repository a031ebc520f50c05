"""CPU-tier slabs: a paged-in adapter's weights, already in the device pool's row layout, in
preallocated blocks of host memory.

Why. A page-in used to keep the blob it read and one tensor view per LoRA factor (16 for rank 1
on q/v of a 4-layer base) as the CPU tier's entry: small, long-lived allocations made between a
step's short-lived activations, which fragmented the engine core's heap (its RSS rose ~25 MiB per
100,000 cold requests; bench/RESULTS.md), and a device-pool load then stacked and transposed the
factors layer by layer. Here a page-in is copied once, by one gather, into a fixed-size slot of a
large block, and the blob and its views are freed at once. The slot holds, per pool kind in the
pool's order, `A` as `[L, r, (E,) in]` then `B` as `[L, r, (E,) out]`: exactly what
`AdapterPool` stores, so a load is one slice copy per kind and side (`SlabWeights.parts`), and a
host-to-device copy of it is one contiguous DMA (the blocks are pinned when the pool is on CUDA).

Size classes. A namespace of a million revisions has a handful of shapes (one per rank and
target set); each shape is a class with its own slots, blocks of `BLOCK_BYTES` (at least one
slot) cut into equal slots. A slot is freed when its `SlabWeights` is collected (the CPU cache
evicted it and no staged request or future holds it), so nothing still read can be overwritten;
a block whose slots are all free is returned to the allocator. The CPU cache's byte bound counts
each entry's slot, so the blocks in use stay within it plus one partly used block per class.

The checks are the page-in's own: the decode's (`catalog.layout.checked_region`: the header, the
tensor table, finite values and the factor bound, exactly `load_revision`'s, without making a
view per tensor) run first, then the pool's layout check (`weights.plan_load`) once per tensor
table (its plan, with the gather index, is kept per checked table). An adapter that skips some
layers of a kind, or that the pool can never hold, is kept as decoded (no slab), as is any
adapter when the slabs are off.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from loraserve.adapters.targets import TargetSpec, TensorSlot
from loraserve.adapters.weights import LoadPlan, plan_load

__all__ = ["SlabWeights", "Slabs", "BLOCK_BYTES"]

BLOCK_BYTES = 1 << 20  # one allocation holds this many bytes of slots (or one slot, if larger)
MAX_PLANS = 256  # tensor tables whose gather plan is kept
GATHER_ELEMS = 1 << 16  # slots up to this many elements are filled by one gather


@dataclass(slots=True, frozen=True)
class _Part:
    """Where one kind's factors sit in a slot (elements from the slot's start)."""

    kind: str
    a_offset: int
    a_shape: tuple[int, ...]  # [L, r, (E,) in]
    b_offset: int
    b_shape: tuple[int, ...]  # [L, r, (E,) out]


@dataclass(slots=True, frozen=True)
class _Plan:
    """How a checked tensor table goes into a slot (checked once by `plan_load`). A small slot
    is one gather, slot[i] = flat[index[i]]: a page-in of a small adapter costs its number of
    ops, not its bytes. A large one (over `GATHER_ELEMS`) is copied factor by factor (`names`),
    which needs no index as large as itself."""

    rank: int
    kinds: tuple[str, ...]
    parts: tuple[_Part, ...]
    elems: int  # slot size
    index: torch.Tensor | None  # int64 [elems] into the blob's flat data region; None: large
    index_np: np.ndarray | None  # the same, for numpy's take
    names: tuple[tuple[str, ...], ...]  # per part, its layers' (A, B) tensor names, in order


class _Block:
    """One allocation cut into `slots` equal slots of `elems` elements."""

    __slots__ = ("data", "raw", "live")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[data.element_size()]
        self.raw = data.view(bits).numpy()  # the same memory as integers: what a bit copy writes
        self.live = 0


class _Class:
    """The slots of one slot size: free ones (block, slot index), blocks by identity."""

    __slots__ = ("elems", "per_block", "free", "blocks")

    def __init__(self, elems: int, per_block: int) -> None:
        self.elems, self.per_block = elems, per_block
        self.free: deque[tuple[_Block, int]] = deque()
        self.blocks: set[_Block] = set()


class SlabWeights:
    """A CPU-tier entry whose factors live in a slab slot, in the pool's layout (module doc).

    The pool reads `rank`, `kinds` and `parts()`; caches read `nbytes` and `tensor_count`.
    Collecting it frees its slot."""

    __slots__ = ("rank", "kinds", "base_fingerprint", "nbytes", "_plan", "_block", "_slot",
                 "_owner", "__weakref__")
    tensor_count = 0  # no per-factor tensors are kept

    def __init__(self, owner: Slabs, plan: _Plan, block: _Block, slot: int, nbytes: int,
                 base_fingerprint: str) -> None:
        self.rank, self.kinds, self._plan = plan.rank, plan.kinds, plan
        self._block, self._slot, self._owner = block, slot, owner
        self.nbytes, self.base_fingerprint = nbytes, base_fingerprint

    def data(self) -> torch.Tensor:
        """The slot, flat."""
        n = self._plan.elems
        return self._block.data[self._slot * n:(self._slot + 1) * n]

    def parts(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(kind, A [L, r, (E,) in], B [L, r, (E,) out]) per kind: views of the slot, made now
        (short-lived: the entry itself keeps no tensor but its block's)."""
        flat = self.data()
        return [(p.kind, flat[p.a_offset:p.a_offset + math.prod(p.a_shape)].view(p.a_shape),
                 flat[p.b_offset:p.b_offset + math.prod(p.b_shape)].view(p.b_shape))
                for p in self._plan.parts]

    def raw_parts(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """`parts()` as numpy views of the slot's bits (integers of the element size): what a
        CPU pool copies with numpy, a few times faster than torch's dispatch for small slices."""
        n = self._plan.elems
        flat = self._block.raw[self._slot * n:(self._slot + 1) * n]
        return [(p.kind, flat[p.a_offset:p.a_offset + math.prod(p.a_shape)].reshape(p.a_shape),
                 flat[p.b_offset:p.b_offset + math.prod(p.b_shape)].reshape(p.b_shape))
                for p in self._plan.parts]

    def __del__(self) -> None:
        owner = self._owner
        if owner is not None:
            owner._free(self._plan.elems, self._block, self._slot)


class Slabs:
    """The slab allocator and gather plans of one device pool (module doc). Thread-safe."""

    def __init__(self, specs: dict[str, TargetSpec], index: dict[str, TensorSlot], max_rank: int,
                 rows_per_kind: int, dtype: torch.dtype, pin_memory: bool = False,
                 block_bytes: int = BLOCK_BYTES) -> None:
        self.specs, self._index = specs, index
        self.max_rank, self.rows_per_kind = max_rank, rows_per_kind
        self.dtype, self.pin_memory, self.block_bytes = dtype, pin_memory, block_bytes
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        self._lock = threading.Lock()
        self._classes: dict[int, _Class] = {}
        self._plans: dict[tuple, _Plan | None] = {}  # None: this table is kept as decoded
        self._freed: deque[tuple[int, _Block, int]] = deque()  # from __del__: no lock taken there

    @classmethod
    def for_pool(cls, pool, pin_memory: bool = False) -> Slabs:
        return cls(pool.specs, pool._index, pool.config.max_rank, pool.rows_per_kind,
                   pool.config.dtype, pin_memory)

    def convert(self, blob: bytearray, meta: dict, layout, start: int) -> SlabWeights | None:
        """A checked blob (`catalog.layout.checked_region`: its metadata, tensor table and where
        its data starts) copied into a slot by one gather; None when its table has no slab plan
        (it skips layers of a kind, or the pool can never hold it: the caller keeps it decoded,
        and the pool's load raises what it always raised)."""
        plan = self._plans.get(id(layout))
        if plan is None or plan[0] is not layout:
            plan = (layout, self._plan(blob, meta, layout, start))
            with self._lock:
                if len(self._plans) >= MAX_PLANS:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[id(layout)] = plan
        plan = plan[1]
        if plan is None:
            return None
        n = plan.elems
        block, slot = self._alloc(n)
        entry = SlabWeights(self, plan, block, slot, n * self._itemsize, meta["base_fingerprint"])
        if plan.index is None:
            _copy_factors(entry, layout.views(blob, start)[1])
        elif layout.dtype == self.dtype:  # a bit copy: numpy's take, no torch dispatch
            raw = np.frombuffer(blob, dtype=block.raw.dtype, offset=start)
            np.take(raw, plan.index_np, out=block.raw[slot * n:(slot + 1) * n], mode="clip")
        else:
            flat = torch.frombuffer(blob, dtype=layout.dtype, offset=start)
            block.data[slot * n:(slot + 1) * n].copy_(flat.index_select(0, plan.index))
        return entry

    def _plan(self, blob: bytearray, meta: dict, layout, start: int) -> _Plan | None:
        """The gather of this tensor table, after the pool's full layout check (`plan_load`)."""
        flat, tensors = layout.views(blob, start)
        try:
            checked: LoadPlan = plan_load(SimpleNamespace(rank=meta["rank"], tensors=tensors), self.specs,
                                          self._index, self.max_rank, self.rows_per_kind)
        except ValueError:
            return None
        base = flat.storage_offset()
        small = flat.numel() <= GATHER_ELEMS
        position = torch.arange(flat.numel(), dtype=torch.int64) if small else flat
        where = {id(t): position.as_strided(tuple(t.shape), t.stride(), t.storage_offset() - base)
                 for t in tensors.values()}
        name_of = {id(t): n for n, t in tensors.items()}
        pieces, parts, names, offset = [], [], [], 0
        for kind in checked.kinds:
            pairs = [checked.tensors.get((kind, layer)) for layer in self.specs[kind].layers]
            if any(p is None for p in pairs):
                return None  # skipped layers: the pool zero-fills them itself (`_copy_in`)
            moe = self.specs[kind].experts > 0
            a = torch.stack([_pool_a(where[id(p[0])], moe) for p in pairs])
            b = torch.stack([_pool_b(where[id(p[1])], moe) for p in pairs])
            parts.append(_Part(kind, offset, tuple(a.shape), offset + a.numel(), tuple(b.shape)))
            names.append(tuple(name_of[id(t)] for p in pairs for t in p))
            pieces += [a.reshape(-1), b.reshape(-1)] if small else []
            offset += a.numel() + b.numel()
        index = torch.cat(pieces) if small else None
        return _Plan(checked.rank, tuple(checked.kinds), tuple(parts), offset, index,
                     None if index is None else index.numpy(), tuple(names))

    def _alloc(self, elems: int) -> tuple[_Block, int]:
        with self._lock:
            self._reclaim()
            cls = self._classes.get(elems)
            if cls is None:
                per_block = max(1, self.block_bytes // (elems * self._itemsize))
                cls = self._classes[elems] = _Class(elems, per_block)
            if not cls.free:
                data = torch.empty(elems * cls.per_block, dtype=self.dtype, pin_memory=self.pin_memory)
                block = _Block(data)
                cls.blocks.add(block)
                cls.free.extend((block, i) for i in range(cls.per_block))
            block, slot = cls.free.popleft()
            block.live += 1
            return block, slot

    def _free(self, elems: int, block: _Block, slot: int) -> None:
        """From `SlabWeights.__del__`, on any thread, maybe inside the garbage collector: queued
        without a lock (deque.append is atomic), taken back by the next allocation."""
        self._freed.append((elems, block, slot))

    def _reclaim(self) -> None:
        """Put freed slots back (lock held); a block with no live slot goes back to the allocator."""
        while self._freed:
            elems, block, slot = self._freed.popleft()
            cls = self._classes[elems]
            block.live -= 1
            cls.free.append((block, slot))
            if block.live == 0 and len(cls.blocks) > 1:
                cls.blocks.discard(block)
                cls.free = deque(s for s in cls.free if s[0] is not block)

    @property
    def block_bytes_allocated(self) -> int:
        """Bytes of the blocks held now (for tests and the bench)."""
        with self._lock:
            self._reclaim()
            return sum(b.data.numel() for c in self._classes.values() for b in c.blocks) * self._itemsize


def _copy_factors(entry: SlabWeights, tensors: dict[str, torch.Tensor]) -> None:
    """A large slot filled factor by factor: each layer's A and B into its rows (converted to
    the slab's dtype by the copy)."""
    for (kind, a_all, b_all), names in zip(entry.parts(), entry._plan.names):
        moe = a_all.dim() == 4
        for layer in range(a_all.shape[0]):
            a_all[layer].copy_(_pool_a(tensors[names[2 * layer]], moe))
            b_all[layer].copy_(_pool_b(tensors[names[2 * layer + 1]], moe))


def _pool_a(a: torch.Tensor, moe: bool) -> torch.Tensor:
    """A factor in the pool's rows: [r, in] as is; MoE [E, r, in] -> [r, E, in] (`AdapterPool._copy_in`)."""
    return a.transpose(0, 1) if moe else a


def _pool_b(b: torch.Tensor, moe: bool) -> torch.Tensor:
    """B factor in the pool's rows: [out, r] -> [r, out]; MoE [E, out, r] -> [r, E, out]."""
    return b.permute(2, 0, 1) if moe else b.t()
