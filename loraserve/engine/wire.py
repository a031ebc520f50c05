"""Value codecs of the engine's wire: requests, output deltas, errors and snapshots as plain msgpack
values (lists, dicts, ints, strings, bytes), never pickled Python objects.

The messages that carry them are `engine.messages` (typed records with a kind, one codec per
kind); this module encodes their fields. Ray Serve replicas and their ingress use the same
value codecs for requests (`request_to_wire(..., resolved=True)`), deltas and errors.

A delta is a list (`output_to_wire`): `RequestOutput`'s fields in their declared order (request
id, token ids, text, logprobs, prompt logprobs, finish reason, ...), read from the dataclass. From
the core its text is always "" (one byte): the API server's `OutputProcessor` detokenizes the
token ids and applies stop strings.

Messages travel back to back over a stream socket: a msgpack value delimits itself, so
`unpacker()` splits the stream into frames with no framing of ours. The heartbeat does not
travel on the socket: see `heartbeat` (two timestamps in shared memory).
"""
from __future__ import annotations

import dataclasses
import operator

import msgpack

from loraserve.catalog.errors import CatalogError
from loraserve.catalog.records import RevisionRecord

from .snapshot import DETAIL_FIELDS, EngineSnapshot
from .types import (EngineError, GenerateRequest, RequestOutput, ResolvedModel, SamplingParams,
                    TokenLogprob)

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))

def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def unpacker() -> msgpack.Unpacker:
    """Feed it the bytes of a stream of packed messages as they arrive; iterate it for the
    messages complete so far (a partial one stays buffered until the rest arrives)."""
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)


def request_to_wire(req: GenerateRequest, resolved: bool = False) -> dict:
    """`resolved`: carry the edge's decision too (`GenerateRequest.resolved`, its revision record
    as JSON), for an engine that gets no record beside the request (a Ray Serve replica); the
    engine-core's "add" message carries the record itself."""
    p = req.params
    d = {"id": req.request_id, "prompt": req.prompt_token_ids,
         "params": {name: getattr(p, name) for name in _PARAM_FIELDS},
         "adapter": req.adapter, "stream": req.stream, "tenant": req.tenant,
         "weight": req.tenant_weight}
    if resolved and req.resolved is not None:
        r = req.resolved  # its key is the record's: it travels as the record
        d["resolved"] = {"name": r.name, "ref": r.ref, "tenant": r.tenant,
                         "record": None if r.record is None else r.record.to_json()}
    return d


def request_from_wire(d: dict) -> GenerateRequest:
    resolved = None
    if (r := d.get("resolved")) is not None:
        record = None if r["record"] is None else RevisionRecord.from_json(r["record"])
        resolved = ResolvedModel(r["name"], r["ref"], tenant=r["tenant"], record=record,
                                 adapter=None if record is None else (record.adapter_id, record.revision))
    return GenerateRequest(d["id"], d["prompt"], SamplingParams(**d["params"]), d["adapter"],
                           d["stream"], d["tenant"], d["weight"], resolved)


def _logprobs_to_wire(lps: list[TokenLogprob | None] | None) -> list | None:
    if lps is None:
        return None
    return [None if lp is None else [lp.token_id, lp.logprob, lp.top] for lp in lps]


def _logprobs_from_wire(lps: list | None) -> list[TokenLogprob | None] | None:
    if lps is None:
        return None
    return [None if lp is None else TokenLogprob(lp[0], lp[1], lp[2]) for lp in lps]


def error_to_wire(err: BaseException) -> dict:
    """An error a client may see: EngineError and catalog errors keep their HTTP status and code
    (a catalog error without one is named after its class, as the server names it)."""
    code = getattr(err, "code", None)
    if code is None and isinstance(err, CatalogError):
        code = _snake(type(err).__name__)
    return {"message": str(err), "status": getattr(err, "status", 500), "code": code,
            "param": getattr(err, "param", None)}


def error_from_wire(d: dict) -> EngineError:
    status = d["status"]
    code = d["code"] or ("internal_error" if status >= 500 else "invalid_request")
    return EngineError(d["message"], status=status, code=code, param=d["param"])


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


# A delta's wire layout is RequestOutput's field order, read from the dataclass: one definition
# of the record, and a field added there travels with no change here. Three fields need a codec
# (logprob records, the error); the rest are msgpack values as they are.
_OUT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput))
_out_values = operator.attrgetter(*_OUT_FIELDS)  # the fields in wire order, in one C call
_OUT_LOGPROBS = tuple(_OUT_FIELDS.index(name) for name in ("logprobs", "prompt_logprobs"))
_OUT_ERROR = _OUT_FIELDS.index("error")


def output_to_wire(out: RequestOutput) -> list:
    o = list(_out_values(out))
    for i in _OUT_LOGPROBS:
        if o[i] is not None:
            o[i] = _logprobs_to_wire(o[i])
    if o[_OUT_ERROR] is not None:
        o[_OUT_ERROR] = error_to_wire(o[_OUT_ERROR])
    return o


def output_from_wire(o: list) -> RequestOutput:
    o = list(o)
    for i in _OUT_LOGPROBS:
        if o[i] is not None:
            o[i] = _logprobs_from_wire(o[i])
    if o[_OUT_ERROR] is not None:
        o[_OUT_ERROR] = error_from_wire(o[_OUT_ERROR])
    return RequestOutput(*o)  # positional in _OUT_FIELDS' order, which output_to_wire wrote


def snapshot_to_wire(s: EngineSnapshot, detail: bool = True) -> dict:
    """The snapshot's fields by name; without `detail`, all but its DETAIL_FIELDS (a peer that
    has them already: `messages.Step.detail`)."""
    d = {name: getattr(s, name) for name in (_SNAPSHOT_FIELDS if detail else _LIGHT_FIELDS)}
    if detail:
        d["resident"] = list(s.resident)
        for name in _SNAPSHOT_STATS:
            d[name] = None if d[name] is None else dataclasses.asdict(d[name])
    return d


_SNAPSHOT_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSnapshot))
_LIGHT_FIELDS = tuple(name for name in _SNAPSHOT_FIELDS if name not in DETAIL_FIELDS)
_SNAPSHOT_STATS = ("pool", "cpu_cache", "pager")  # adapters.stats dataclasses, or None


def _frozen(value):
    """msgpack's arrays back as the snapshot's tuples (nested ones too)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def snapshot_from_wire(d: dict, pool_stats, cache_stats, pager_stats) -> EngineSnapshot:
    """`*_stats`: the dataclasses to rebuild the tier stats with (adapters.stats). Every array
    field comes back a tuple (of tuples), as the snapshot holds it: a field added there
    travels with no change here."""
    d = {k: v if k in _SNAPSHOT_STATS else _frozen(v) for k, v in d.items()}
    if "resident" in d:  # sent with its detail (a snapshot without has the defaults there)
        d["resident"] = frozenset(d["resident"])
    for name, cls in zip(_SNAPSHOT_STATS, (pool_stats, cache_stats, pager_stats)):
        if d.get(name) is not None:
            d[name] = cls(**d[name])
    return EngineSnapshot(**d)


def snapshot_has_detail(d: dict) -> bool:
    """Whether a snapshot's wire dict carries its DETAIL_FIELDS."""
    return "detail_at" in d
