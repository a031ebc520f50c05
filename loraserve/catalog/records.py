"""Catalog records, stored as compact JSON values in each shard's LMDB.

Keys (per shard env; see `catalog.shards`): the `policy` db maps `adapter_id` to a
`PolicyRecord`, the `revision` db maps `adapter_id@revision` to a `RevisionRecord`, and the
`blob` db maps the same key to the revision's safetensors bytes. JSON keys are the field
names below; times are Unix seconds (float). A revision record is written once and never
changed; a policy record is rewritten on every promote / rollback / tag / new revision.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import orjson

RECORD_FORMAT = 1


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _fields(obj) -> dict:
    # shallow field dict; dataclasses.asdict deep-copies and is several times slower
    return {name: getattr(obj, name) for name in obj.__slots__}


def _loads(cls, raw: bytes | memoryview, what: str):
    # orjson: a quarter of the stdlib parser's time on a record (a shard host decodes a policy
    # and a revision record for each cold lookup); its errors are ValueErrors too
    data = orjson.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"malformed {what} record: not a JSON object")
    data.pop("v", None)
    try:
        return cls(**data)
    except TypeError as e:  # unknown/missing keys: a record from an incompatible writer
        raise ValueError(f"malformed {what} record: {e}") from None


@dataclass(slots=True)
class RevisionRecord:
    """One immutable adapter revision: where its blob is and what it was built against."""

    adapter_id: str
    revision: str
    size: int  # blob bytes
    checksum: str  # xxh3-128 hex of the blob
    created: float
    base_fingerprint: str
    rank: int
    targets: list[str]  # short target kinds, e.g. ["q_proj", "experts.down_proj"]
    dtype: str  # serving dtype name, e.g. "float32", "bfloat16"
    source: str = ""

    def __post_init__(self) -> None:
        if self.size < 0 or self.rank < 1:
            raise ValueError(f"bad revision record for {self.adapter_id}@{self.revision}")

    @property
    def ref(self) -> str:
        """`adapter_id@revision`, the key of this revision in its shard."""
        return f"{self.adapter_id}@{self.revision}"

    def to_json(self) -> bytes:
        return _dumps({"v": RECORD_FORMAT, **_fields(self)})

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> RevisionRecord:
        return _loads(cls, raw, "revision")


@dataclass(slots=True)
class PolicyRecord:
    """The mutable per-adapter record: revisions in creation order, promotion state, tags."""

    adapter_id: str
    base_fingerprint: str
    rank: int  # rank of the latest revision
    targets: list[str]
    revisions: list[str] = field(default_factory=list)
    promoted: str | None = None
    previous: str | None = None  # promoted revision before the last promote (rollback target)
    tags: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0

    def __post_init__(self) -> None:
        for rev in (self.promoted, self.previous, *self.tags.values()):
            if rev is not None and rev not in self.revisions:
                raise ValueError(f"policy of {self.adapter_id} names unknown revision {rev!r}")

    def to_json(self) -> bytes:
        return _dumps({"v": RECORD_FORMAT, **_fields(self)})

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> PolicyRecord:
        return _loads(cls, raw, "policy")

    def to_dict(self) -> dict:
        return {**_fields(self), "revisions": list(self.revisions), "tags": dict(self.tags)}
