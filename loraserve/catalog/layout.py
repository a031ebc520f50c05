"""Adapter weights in serving layout and their safetensors blob (docs/INTERNALS.md §1).

`save_revision` / `load_revision` are the only ways a revision becomes bytes and back;
both check the layout so a blob that loads is one the engine can use as is: every target's
`lora_A`/`lora_B` present, one rank `R` everywhere, scale already folded into B.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import orjson
import safetensors.torch
import torch

from .bounds import GainPlan, as_float32, check_servable, gain_limit
from .dtypes import DTYPES_BY_NAME, dtype_name, name_of_code, torch_dtype
from .errors import CorruptBlob
from .format import FORMAT, canonical_blob, check_adapter_meta, read_header
from .safetensors_header import PREFIX, header_length
from .lru import BoundedLRU
from .targets import EXPERT_KINDS, module_path, parse_tensor_name, tensor_names


def _check_pair(path: str, kind: str, a: torch.Tensor, b: torch.Tensor, rank: int) -> None:
    ndim = 3 if kind in EXPERT_KINDS else 2
    if a.dim() != ndim or b.dim() != ndim:
        raise ValueError(f"{path}: lora_A/lora_B must be {ndim}-D, got {list(a.shape)} / {list(b.shape)}")
    if a.shape[-2] != rank or b.shape[-1] != rank:
        raise ValueError(f"{path}: rank {a.shape[-2]}/{b.shape[-1]} differs from adapter rank {rank}")
    if ndim == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"{path}: expert counts differ, {a.shape[0]} vs {b.shape[0]}")


def check_layout(weights: AdapterWeights) -> None:
    """Raise ValueError unless `weights` is a complete, consistent serving-layout adapter."""
    halves: dict[tuple[str, int | None], set[bool]] = {}  # (kind, layer) -> {is lora_A}
    for name, t in weights.tensors.items():
        kind, layer, is_a = parse_tensor_name(name)
        if kind not in weights.targets:
            raise ValueError(f"{name}: kind {kind!r} is not among the targets {weights.targets}")
        if t.dtype != weights.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from adapter dtype {weights.dtype}")
        halves.setdefault((kind, layer), set()).add(is_a)
    for (kind, layer), seen_a in halves.items():
        path = module_path(kind, layer)
        if seen_a != {True, False}:
            raise ValueError(f"{path}: needs both lora_A and lora_B")
        a_name, b_name = tensor_names(kind, layer)
        _check_pair(path, kind, weights.tensors[a_name], weights.tensors[b_name], weights.rank)
    covered = {kind for kind, _ in halves}
    if covered != set(weights.targets):
        raise ValueError(f"targets {weights.targets} but tensors cover {sorted(covered)}")


@dataclass(slots=True)
class AdapterWeights:
    """One adapter revision in serving layout (scale folded into B, contiguous, serving dtype)."""

    base_fingerprint: str
    rank: int
    targets: list[str]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [R, in] / [out, R] / [E, R, in] / [E, out, R]
    source: str = ""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        dtype_name(self.dtype)
        check_layout(self)

    @property
    def nbytes(self) -> int:
        """Total tensor bytes (what the adapter costs in memory)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def meta(self) -> dict[str, str]:
        """The blob's `__metadata__` (all strings)."""
        return {
            "format": FORMAT,
            "base_fingerprint": self.base_fingerprint,
            "rank": str(self.rank),
            "targets": ",".join(self.targets),
            "dtype": dtype_name(self.dtype),
            "source": self.source,
        }


def save_revision(weights: AdapterWeights, *, check: bool = True) -> bytes:
    """Serialize to one safetensors blob (tensors made contiguous); equal weights give equal bytes.

    Every writer's way to a blob, so it refuses what no engine may serve (`bounds.check_servable`:
    NaN, Inf, or factors that can overflow the dtype). `check=False` only for tests that need such
    a blob to prove the other entries refuse it."""
    check_layout(weights)
    if check:
        check_servable(weights.tensors, dtype_name(weights.dtype))
    tensors = {k: v.contiguous() for k, v in weights.tensors.items()}
    return canonical_blob(safetensors.torch.save(tensors, metadata=weights.meta))


def load_revision(blob: bytes | bytearray | memoryview, *, what: str = "adapter blob",
                  finite: bool = False, compute_dtype: str | None = None) -> AdapterWeights:
    """Parse a revision blob (safetensors only, never pickle); CorruptBlob (naming `what`) if it
    is malformed, or with `finite` if a value is NaN or Inf; with `finite`, also FactorsTooLarge
    (400) if its factors can overflow its dtype or `compute_dtype` (`bounds`: the check export and
    import make, here on the flat data region in a few numpy calls, `bounds.GainPlan`).

    Every tensor is a view into one writable buffer, so a blob is copied at most once: a
    `bytearray` is used as it is (the caller hands it over: the tensors share its memory; this is
    how a page-in decodes what `Catalog.read_blobs` copied out of the LMDB map), anything else
    is copied into one first. The header is checked as strictly as safetensors checks it: known
    dtype codes, each tensor's byte range matching its shape, the ranges tiling the data region
    with no gap, overlap or trailing byte; and every tensor must have the adapter's dtype. So the
    data region is one array of that dtype, which makes each tensor a single `as_strided` of it
    and the finiteness check one reduction over it rather than a few small ops per tensor (a
    page-in of a small adapter is dominated by such per-op overhead). The data is read as
    little-endian, the byte order of every host loraserve runs on.

    The checks of the tensor table and of the serving layout (`check_layout`) depend only on the
    table, the dtype, the rank and the targets, and a namespace of a million revisions holds a
    handful of such layouts (one per rank and target set): each is checked in full once, kept in
    a small cache keyed by exactly those inputs, and reused for every later blob with the same
    table (`_LAYOUTS`). What differs per blob (its length, its values) is checked every time.
    """
    buf = blob if isinstance(blob, bytearray) else bytearray(blob)
    entries, raw_meta, start = read_header(buf, what)
    meta = check_adapter_meta(raw_meta, what)
    try:
        key = (orjson.dumps(entries), meta["dtype"], meta["rank"], tuple(meta["targets"]))
    except TypeError:  # a table orjson cannot write back (e.g. an integer past 64 bits): no key
        key = None
    layout = _LAYOUTS.get(key) if key is not None else None
    try:
        if layout is None or len(buf) - start != layout.data_bytes:
            flat, tensors = _tensor_views(buf, entries, start, meta["dtype"])
            weights = AdapterWeights(base_fingerprint=meta["base_fingerprint"], rank=meta["rank"],
                                     targets=meta["targets"], dtype=torch_dtype(meta["dtype"]),
                                     tensors=tensors, source=meta["source"])
            layout = _Layout.of(flat, tensors, len(buf) - start)
            if key is not None:
                _LAYOUTS.put(key, layout)
        else:
            flat, tensors = layout.views(buf, start)
            weights = _checked_weights(meta, layout.dtype, tensors)
        if finite:
            _check_values(buf, start, meta["dtype"], lambda: (flat, tensors), layout.gains, compute_dtype, what)
        return weights
    except (ValueError, RuntimeError) as e:
        raise CorruptBlob(f"{what}: {e}") from None


def checked_region(blob: bytearray, *, what: str = "adapter blob",
                   compute_dtype: str | None = None) -> tuple[dict, _Layout, int]:
    """`load_revision(blob, finite=True, compute_dtype=...)`'s checks, all of them, without
    making the per-tensor views: (the checked metadata, the blob's checked `_Layout`, where its
    data region starts). For a caller that copies the data region elsewhere at once (a page-in
    into a CPU-tier slab, `loraserve.adapters.slabs`): the views are the larger part of a decode
    whose table was seen before. A table not seen before goes through `load_revision` itself
    (which checks it in full and keeps its layout)."""
    raw = _header_bytes(blob, what)
    meta, key, start = _HEADERS.get(raw) or _header_of(blob, raw, what)
    layout = _LAYOUTS.get(key) if key is not None else None
    if layout is None or len(blob) - start != layout.data_bytes:
        load_revision(blob, what=what, finite=True, compute_dtype=compute_dtype)
        layout = _LAYOUTS.get(key) if key is not None else None
        if layout is None:  # a table the cache cannot hold: no region to hand out
            raise CorruptBlob(f"{what}: tensor table cannot be keyed")
        return meta, layout, start
    try:
        _check_values(blob, start, meta["dtype"], lambda: layout.views(blob, start), layout.gains,
                      compute_dtype, what)
    except (ValueError, RuntimeError) as e:
        raise CorruptBlob(f"{what}: {e}") from None
    return meta, layout, start


def _header_bytes(blob: bytearray, what: str) -> bytes:
    """The blob's header (the JSON after the length prefix), as bytes: `_HEADERS`' key."""
    n = header_length(bytes(blob[:PREFIX.size]), len(blob), what, CorruptBlob)
    return bytes(blob[PREFIX.size:PREFIX.size + n])


def _header_of(blob: bytearray, raw: bytes, what: str) -> tuple[Mapping, tuple | None, int]:
    """(checked metadata, `_LAYOUTS` key or None, data offset) of a blob's header, parsed and
    checked, and kept in `_HEADERS` under its bytes `raw`."""
    entries, raw_meta, start = read_header(blob, what)
    meta = MappingProxyType(check_adapter_meta(raw_meta, what))  # shared by every blob with this header
    try:
        key = (orjson.dumps(entries), meta["dtype"], meta["rank"], tuple(meta["targets"]))
    except TypeError:  # a table orjson cannot write back (e.g. an integer past 64 bits): no key
        key = None
    head = (meta, key, start)
    if len(raw) <= HEADER_CACHE_BYTES:
        _HEADERS.put(raw, head)
    return head


def _check_values(buf: bytearray, start: int, dtype: str, views, plan: GainPlan,
                  compute_dtype: str | None, what: str) -> None:
    """The page-in's value check: the gain over the whole data region at once; only a blob that
    fails it pays for finding the tensor (NaN/Inf: ValueError, a corrupt blob) or the target
    (finite but too large: FactorsTooLarge) to name, from `views()`: (flat region, tensors)."""
    int_type = _EXPONENT_BITS[dtype][0]
    raw = np.frombuffer(buf, dtype=np.float32 if dtype == "float32" else int_type, offset=start)
    if dtype == "float16":
        raw = raw.view(np.float16)
    limit = gain_limit(dtype, compute_dtype or dtype)
    if plan.gain(as_float32(raw, dtype), limit) <= limit:
        return
    flat, tensors = views()
    if not _all_finite(buf, start, dtype):
        base = flat.storage_offset()
        bad = next(n for n, t in tensors.items() if not _all_finite(
            buf, start, dtype, t.storage_offset() - base, t.numel()))
        raise ValueError(f"tensor {bad} holds NaN or Inf; it is not served")
    check_servable(tensors, dtype, compute_dtype, f" ({what})")


def _checked_weights(meta: dict, dtype: torch.dtype, tensors: dict[str, torch.Tensor]) -> AdapterWeights:
    """AdapterWeights whose layout a `_Layout` has already checked (`check_layout` is skipped)."""
    weights = object.__new__(AdapterWeights)
    weights.base_fingerprint, weights.rank = meta["base_fingerprint"], meta["rank"]
    weights.targets, weights.dtype, weights.tensors = meta["targets"], dtype, tensors
    weights.source = meta["source"]
    return weights


@dataclass(frozen=True, slots=True)
class _Layout:
    """A tensor table that passed every check: each tensor's name, shape, strides and element
    offset in the data region, the region's byte length and dtype."""

    dtype: torch.dtype
    data_bytes: int
    tensors: tuple[tuple[str, tuple[int, ...], tuple[int, ...], int], ...]
    gains: GainPlan  # the table's value check (`bounds.GainPlan`), planned once with the rest

    @classmethod
    def of(cls, flat: torch.Tensor, tensors: dict[str, torch.Tensor], data_bytes: int) -> _Layout:
        base = flat.storage_offset()
        table = tuple((name, tuple(t.shape), t.stride(), t.storage_offset() - base)
                      for name, t in tensors.items())
        return cls(flat.dtype, data_bytes, table, GainPlan([(n, s, o) for n, s, _, o in table]))

    def views(self, buf: bytearray, start: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The flat data region of `buf` and its tensors, as `_tensor_views` makes them."""
        flat = torch.frombuffer(buf, dtype=self.dtype, offset=start)
        base = flat.storage_offset()
        return flat, {name: flat.as_strided(shape, strides, base + offset)
                      for name, shape, strides, offset in self.tensors}


class _LayoutCache(BoundedLRU[tuple, _Layout]):
    """The checked layouts, least recently used out beyond `capacity`; safe across threads (pager
    workers decode at once): a lookup and an insert each hold the map's lock once."""

    __slots__ = ()

    def __init__(self, capacity: int = 256) -> None:
        super().__init__(capacity)


_LAYOUTS = _LayoutCache()
# A page-in's header, parsed and checked, by its bytes. Revisions of one layout exported for one
# base have byte-identical headers (the format writes no per-revision field, and its JSON is
# canonical), so a namespace of a million revisions holds a handful: a hit skips the JSON parse
# and the metadata checks, about a third of a small adapter's decode. What the header cannot
# say (the blob's length, its values) is checked every time, as before. Bounded in bytes too: a
# header past HEADER_CACHE_BYTES (a header may be up to 100 MiB) is parsed every time, so the
# cache holds at most 128 x 256 KiB whatever blobs it sees (a dense 80-layer adapter of all 7
# targets has a ~130 KB header).
HEADER_CACHE_BYTES = 256 * 1024
_HEADERS: BoundedLRU[bytes, tuple[Mapping, tuple | None, int]] = BoundedLRU(128)


def _tensor_views(buf: bytearray, entries: dict, start: int,
                  serving: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The data region of `buf` (from `start`) as a flat tensor of dtype `serving`, and name ->
    tensor viewing its part of it. ValueError for an entry that is not a well-formed tensor of
    that dtype, or entries that do not tile the data region exactly."""
    itemsize = DTYPES_BY_NAME[serving].itemsize
    spans = []
    for name, entry in entries.items():
        try:
            code, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: malformed tensor entry") from None
        if not all(type(x) is int and x >= 0 for x in (*shape, begin, end)):  # JSON true is no size
            raise ValueError(f"{name}: shape and offsets must be non-negative integers")
        if name_of_code(code) != serving:
            raise ValueError(f"{name}: dtype code {code!r} differs from adapter dtype {serving}")
        if end - begin != math.prod(shape) * itemsize:
            raise ValueError(f"{name}: {end - begin} bytes for shape {shape} of {serving}")
        spans.append((begin, end, name, shape))
    spans.sort(key=lambda s: (s[0], s[1]))
    covered = 0
    for begin, end, name, _ in spans:
        if begin != covered:
            raise ValueError(f"{name}: data offsets leave a gap or overlap at byte {covered}")
        covered = end
    if start + covered != len(buf):
        raise ValueError(f"{len(buf) - start - covered} bytes after the last tensor")
    if not covered:
        raise ValueError("no tensor data")
    flat = torch.frombuffer(buf, dtype=getattr(torch, serving), offset=start)
    base = flat.storage_offset()
    return flat, {name: flat.as_strided(shape, _contiguous_strides(shape), base + begin // itemsize)
                  for begin, _, name, shape in spans}


# Inf and NaN are the values whose exponent bits are all ones: (integer view, exponent mask)
_EXPONENT_BITS = {"float32": (np.uint32, 0x7F800000), "bfloat16": (np.uint16, 0x7F80),
                  "float16": (np.uint16, 0x7C00)}


def _all_finite(buf: bytearray, start: int, serving: str, first: int = 0,
                count: int = -1) -> bool:
    """Whether every value of the data region (`buf[start:]`, one array of `serving`) is finite,
    or of its `count` values from value `first` on, by their exponent bits in numpy. Not a torch reduction: this runs on pager threads, and a
    torch op that big runs an OpenMP parallel region there, which gives the process a second
    OpenMP thread team for good. With more OpenMP threads than cores, the engine's own team
    decoded 22% slower at 2 threads ever after (one adapter, H 512: 555 -> 430 tokens/s;
    bench/RESULTS.md). numpy's element-wise ops use no thread pool."""
    int_type, mask = _EXPONENT_BITS[serving]
    bits = np.frombuffer(buf, dtype=int_type, offset=start + first * np.dtype(int_type).itemsize,
                         count=count)
    return not bool(np.any(np.bitwise_and(bits, mask) == mask))


def _contiguous_strides(shape: list[int]) -> list[int]:
    """Row-major strides (in elements) of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]
