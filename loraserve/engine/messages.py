"""The one message set between the API side and the engine core, whatever carries it.

Every message is a frozen record with a `Kind`; the core (`core.engine_core.EngineCore`) takes
them in and hands outputs and returns back, and a transport only moves them: the in-thread one
(`async_engine`) puts the records themselves on a queue, the process one (`core.process`,
`client.core_client`) sends their msgpack encoding over a socket (`encode` / `decode`).

    API side -> core                              core -> API side
    Hello()                                       Ready(info)        (the answer to Hello)
    Add(request, record | None)                   Step(outputs, snapshot | None)
    Abort(request_id)                             Return(call_id, value, error | None)
    Unload(call_id, adapter_id)       calls: each is answered by one Return with its call_id
    Residency(call_id, keys)
    Warm(call_id, record)
    Train(call_id, op, args)
    Stop()
    Batch(messages)                               (the commands above, in order: one send for many)

On the wire a message is a msgpack array `[kind, field, ...]`, its fields in declaration order,
each through its value codec (`wire`: requests, deltas, errors, snapshots; a revision record as
its JSON). `decode` picks the record by kind (an int), never by a string. A frame that does not
decode is that frame's fault: `decode` raises `MalformedMessage` naming the kind and what was
wrong, and `decode_batch` turns each bad frame of a batch into a `Malformed` record carrying the
error and, where it could be read, the request id or call id to fail, so the core answers that
one request or call and goes on.

A step message carries one engine step's deltas and, when due, the snapshot: one send per step
however many requests it served. Its encoding is the hot path's, unchanged by the records
(`wire.output_to_wire`: a delta's fields in RequestOutput's order).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from loraserve.catalog.base import QuantizedFingerprint
from loraserve.catalog.records import RevisionRecord

from ..adapters.stats import CacheStats, PagerStats, PoolStats
from .snapshot import EngineSnapshot
from .types import EngineError, GenerateRequest, RequestOutput
from .wire import (error_from_wire, error_to_wire, output_from_wire, output_to_wire, pack,
                   request_from_wire, request_to_wire, snapshot_from_wire, snapshot_has_detail,
                   snapshot_to_wire)


class Kind(enum.IntEnum):
    HELLO = 0
    READY = 1
    ADD = 2
    ABORT = 3
    UNLOAD = 4
    RESIDENCY = 5
    WARM = 6
    TRAIN = 7
    STOP = 8
    STEP = 9
    RETURN = 10
    BATCH = 11


class MalformedMessage(EngineError):
    """A frame that does not decode into a message: its kind, what was wrong, and the request
    or call it names where that much could be read (to fail that one and no other)."""

    status = 500
    code = "malformed_message"

    def __init__(self, reason: str, kind: int | None = None, request_id: str | None = None,
                 call_id: int | None = None):
        name = Kind(kind).name if type(kind) is int and kind in Kind._value2member_map_ else repr(kind)
        super().__init__(f"malformed {name} message: {reason}")
        self.kind, self.request_id, self.call_id = kind, request_id, call_id


# -- the records -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What a core tells the API side once (its handshake): who it is, what it serves, and the
    pool limits an adapter must fit."""

    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    base_fingerprint: str | None
    max_rank: int
    kinds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Hello:
    KIND: ClassVar[Kind] = Kind.HELLO


@dataclass(frozen=True, slots=True)
class Ready:
    info: CoreInfo
    KIND: ClassVar[Kind] = Kind.READY


@dataclass(frozen=True, slots=True)
class Add:
    request: GenerateRequest
    record: RevisionRecord | None  # the revision it runs on, decided at the edge; None: the base
    # the revision's blob, read (and verified) at the edge with its record, for a page-in that
    # then reads nothing (`IsolatedCatalog.take_carried`); None: the engine reads it if it must
    blob: bytes | None = None
    KIND: ClassVar[Kind] = Kind.ADD


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    KIND: ClassVar[Kind] = Kind.ABORT


@dataclass(frozen=True, slots=True)
class Unload:
    """Evict adapter_id's idle revisions (device pool and CPU tier): Return(value=count)."""

    call_id: int
    adapter_id: str
    KIND: ClassVar[Kind] = Kind.UNLOAD


@dataclass(frozen=True, slots=True)
class Residency:
    """Where each (adapter_id, revision) is: Return(value=[gpu|cpu|disk|quarantined, ...])."""

    call_id: int
    keys: tuple[tuple[str, str], ...]
    KIND: ClassVar[Kind] = Kind.RESIDENCY


@dataclass(frozen=True, slots=True)
class Warm:
    """Page `record` into the CPU tier without blocking the loop: Return once it is there."""

    call_id: int
    record: RevisionRecord
    KIND: ClassVar[Kind] = Kind.WARM


@dataclass(frozen=True, slots=True)
class Train:
    """One training operation (engine/training.py): `op` of `TrainerCore.handle`, its args."""

    call_id: int
    op: str
    args: tuple
    KIND: ClassVar[Kind] = Kind.TRAIN


@dataclass(frozen=True, slots=True)
class Stop:
    KIND: ClassVar[Kind] = Kind.STOP


@dataclass(frozen=True, slots=True)
class Step:
    outputs: tuple[RequestOutput, ...]
    snapshot: EngineSnapshot | None  # None: unchanged, or not due yet
    # False: the snapshot is sent without its detail (snapshot.DETAIL_FIELDS), which is the one
    # the peer got last (the engine carried it over): the receiver keeps its own
    detail: bool = True
    KIND: ClassVar[Kind] = Kind.STEP


@dataclass(frozen=True, slots=True)
class Return:
    call_id: int
    value: Any  # a msgpack value
    error: EngineError | None = None
    KIND: ClassVar[Kind] = Kind.RETURN


@dataclass(frozen=True, slots=True)
class Batch:
    messages: tuple[Message, ...]
    KIND: ClassVar[Kind] = Kind.BATCH


@dataclass(frozen=True, slots=True)
class Malformed:
    """A frame `decode_batch` could not decode (never sent: made by the receiving side)."""

    error: MalformedMessage


Call = Unload | Residency | Warm | Train
Message = Hello | Ready | Add | Abort | Unload | Residency | Warm | Train | Stop | Step | Return | Batch
CALLS = (Unload, Residency, Warm, Train)


# -- codecs: one pair per kind -----------------------------------------------------------------

def _record_to(rec: RevisionRecord | None):
    return None if rec is None else rec.to_json()


def _record_from(value) -> RevisionRecord | None:
    return None if value is None else RevisionRecord.from_json(value)


_ENCODE = {
    Hello: lambda m: [],
    Ready: lambda m: [[_fingerprint_to_wire(m.info.base_fingerprint) if f == "base_fingerprint"
                       else getattr(m.info, f) for f in CoreInfo.__slots__]],
    Add: lambda m: [request_to_wire(m.request), _record_to(m.record), *(() if m.blob is None else (m.blob,))],
    Abort: lambda m: [m.request_id],
    Unload: lambda m: [m.call_id, m.adapter_id],
    Residency: lambda m: [m.call_id, [list(k) for k in m.keys]],
    Warm: lambda m: [m.call_id, m.record.to_json()],
    Train: lambda m: [m.call_id, m.op, list(m.args)],
    Stop: lambda m: [],
    Step: lambda m: [[output_to_wire(o) for o in m.outputs],
                     None if m.snapshot is None else snapshot_to_wire(m.snapshot, m.detail)],
    Return: lambda m: [m.call_id, m.value, None if m.error is None else error_to_wire(m.error)],
    Batch: lambda m: [[to_wire(x) for x in m.messages]],
}


def _fingerprint_to_wire(fp: str | None):
    """A quantized base's fingerprint travels with what it accepts (catalog.base.
    QuantizedFingerprint: the float base's adapters on a lossless repack, or when allowed), as
    [float fingerprint, quantization, allow_float]; msgpack alone would leave a bare str, and the
    API side would refuse the float base's adapters the core serves."""
    if isinstance(fp, QuantizedFingerprint):
        return [fp.float_fingerprint, fp.removeprefix(fp.float_fingerprint + "+"), fp.allow_float]
    return fp


def _fingerprint_from(value) -> str | None:
    if isinstance(value, list):
        if len(value) != 3 or not all(isinstance(v, str) for v in value[:2]) or not isinstance(value[2], bool):
            raise MalformedMessage(f"base_fingerprint: {value!r:.80} is no quantized fingerprint")
        return QuantizedFingerprint(*value)
    return value


def _info_from(values: list) -> CoreInfo:
    *head, kinds = values
    info = CoreInfo(*head, tuple(_str(k) for k in kinds))
    return replace(info, base_fingerprint=_fingerprint_from(info.base_fingerprint))


def _snapshot_from(value) -> EngineSnapshot | None:
    return None if value is None else snapshot_from_wire(value, PoolStats, CacheStats, PagerStats)


_DECODE = {
    Kind.HELLO: lambda: Hello(),
    Kind.READY: lambda info: Ready(_info_from(info)),
    Kind.ADD: lambda req, rec, blob=None: Add(request_from_wire(req), _record_from(rec), _blob(blob, rec)),
    Kind.ABORT: lambda rid: Abort(_str(rid)),
    Kind.UNLOAD: lambda cid, aid: Unload(_int(cid), _str(aid)),
    Kind.RESIDENCY: lambda cid, keys: Residency(_int(cid), tuple((_str(a), _str(r)) for a, r in keys)),
    Kind.WARM: lambda cid, rec: Warm(_int(cid), RevisionRecord.from_json(rec)),
    Kind.TRAIN: lambda cid, op, args: Train(_int(cid), _str(op), tuple(args)),
    Kind.STOP: lambda: Stop(),
    Kind.STEP: lambda outs, snap: Step(tuple(output_from_wire(o) for o in outs), _snapshot_from(snap),
                                       snap is None or snapshot_has_detail(snap)),
    Kind.RETURN: lambda cid, value, err: Return(_int(cid), value,
                                                None if err is None else error_from_wire(err)),
    Kind.BATCH: lambda frames: Batch(tuple(decode(f) for f in frames)),
}


def _blob(value, record) -> bytes | None:
    """An Add's carried blob: bytes, and only beside a revision record."""
    if value is None:
        return None
    if not isinstance(value, bytes) or record is None:
        raise TypeError("blob: expected bytes beside a revision record")
    return value


def _str(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _int(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def to_wire(msg: Message) -> list:
    """msg as a msgpack value: [kind, field, ...]."""
    return [int(msg.KIND), *_ENCODE[type(msg)](msg)]


def encode(msg: Message) -> bytes:
    return pack(to_wire(msg))


def decode(frame) -> Message:
    """The message a frame (one unpacked msgpack value) holds; MalformedMessage if it holds
    none: not an array, an unknown kind, the wrong number of fields, or a field that does not
    decode (a request whose parameters are out of range included)."""
    if not isinstance(frame, (list, tuple)) or not frame:
        raise MalformedMessage(f"expected [kind, ...], got {type(frame).__name__}")
    kind, *fields = frame
    if type(kind) is not int or kind not in Kind._value2member_map_:
        raise MalformedMessage("unknown kind", kind if type(kind) is int else None)
    try:
        return _DECODE[kind](*fields)
    except MalformedMessage:
        raise
    except Exception as exc:  # anything a field's codec raises is this frame's fault
        raise MalformedMessage(f"{type(exc).__name__}: {exc}", kind, *_names(kind, fields)) from exc


def _names(kind: int, fields: list) -> tuple[str | None, int | None]:
    """The request id or call id a malformed frame names, where it can be read."""
    first = fields[0] if fields else None
    if kind == Kind.ADD and isinstance(first, dict) and isinstance(first.get("id"), str):
        return first["id"], None
    if kind in (Kind.UNLOAD, Kind.RESIDENCY, Kind.WARM, Kind.TRAIN, Kind.RETURN) \
            and isinstance(first, int) and not isinstance(first, bool):
        return None, first
    return None, None


def decode_batch(frame) -> list[Message | Malformed]:
    """The commands a frame holds, a batch's in order; each frame that does not decode becomes
    a `Malformed` in its place (the others are unaffected)."""
    if isinstance(frame, (list, tuple)) and frame and type(frame[0]) is int and frame[0] == Kind.BATCH \
            and len(frame) == 2 and isinstance(frame[1], (list, tuple)):
        return [m for f in frame[1] for m in decode_batch(f)]
    try:
        return [decode(frame)]
    except MalformedMessage as exc:
        return [Malformed(exc)]
