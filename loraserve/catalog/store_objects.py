"""The durable tier's objects: one `s3://bucket/prefix` and the keys the catalog keeps under it.

    blobs/<xxh3-128>                         a revision's blob, content-addressed and immutable
    revisions/<tenant>/<name>/<rev>.json      its revision record (immutable)
    policies/<tenant>/<name>.json             the adapter's policy record: revisions, promoted,
                                              previous, tags, and `deleted`, the revisions
                                              deleted {id: unix time} (rewritten on each change;
                                              no revision left: the adapter is deleted)
    log/<unix ns>-<host>-<n>-<quoted id>      the change log: one entry per policy change
    log-snapshot.json, log-pruned.json        what compaction pruned from the log (store_log)
    segments/<uuid>                           revisions' blobs end to end, one segment per
                                              publish (store_publish) or bulk part (store_bulk);
                                              the policy's `placed` says where each is (its
                                              record rides along)

Every key but a policy's and the log's is written once. A publish puts its revisions' blobs in
a new segment, under a key never used before, and their records in the policy: it writes no
`blobs/` or `revisions/` object (those are read, from stores written before segments, and
collected). That is what makes the store GC safe by construction (store_gc).

`ObjectStore` reads and writes them through boto3 (endpoint and credentials from the standard
AWS environment and config). Every error is one of ours: a missing key is SourceNotFound (or
None / False where absence is an answer), anything else SourceUnavailable (503); a blob that
fails its record's checksum is CorruptBlob.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

from .errors import CatalogError, CorruptBlob, SourceNotFound, SourceUnavailable
from .fetchers import s3_error
from .format import blob_checksum
from .records import PolicyRecord, RevisionRecord

log = logging.getLogger(__name__)


class WriteConflict(CatalogError):
    """A conditional write lost: the object was created or changed by another writer."""

    status = 409


@dataclass(slots=True)
class PolicyDoc:
    """An adapter's policy object: the record (None: the store never had the adapter), the
    revisions deleted {id: unix time}, and where bulk-published revisions are (`placed`:
    revision id -> its record's fields plus `segment` (key) and `offset`: store_bulk)."""

    policy: PolicyRecord | None
    deleted: dict[str, float] = field(default_factory=dict)
    placed: dict[str, dict] = field(default_factory=dict)


def policy_bytes(doc: PolicyDoc) -> bytes:
    """The policy object's body: the record's fields plus `deleted` and `placed` when any."""
    out = json.loads(doc.policy.to_json())
    if doc.deleted:
        out["deleted"] = doc.deleted
    if doc.placed:
        out["placed"] = doc.placed
    return json.dumps(out, separators=(",", ":"), sort_keys=True).encode()


def parse_policy(raw: bytes) -> PolicyDoc:
    """A policy object's body (`policy_bytes`) read back."""
    doc = json.loads(raw)
    deleted, placed = doc.pop("deleted", {}), doc.pop("placed", {})
    return PolicyDoc(PolicyRecord.from_json(json.dumps(doc).encode()), deleted, placed)


def parse_store_uri(uri: str) -> tuple[str, int | None]:
    """`s3://bucket/prefix[?cache_mb=N]` -> (the store's URI, the local bound in MiB or None)."""
    base, sep, query = uri.partition("?")
    if not sep:
        return uri, None
    key, eq, value = query.partition("=")
    if key != "cache_mb" or not eq or not value.isdigit() or int(value) < 1:
        raise CatalogError(f"catalog store {uri!r}: the one option is ?cache_mb=N (N >= 1 MiB)")
    return base, int(value)


class ObjectStore:
    """The keys of one `s3://bucket/prefix` (module doc) through boto3 (standard AWS config)."""

    def __init__(self, uri: str, timeout_s: float = 10.0, max_pool: int = 10) -> None:
        import boto3
        from botocore.config import Config
        scheme, sep, rest = uri.partition("://")
        bucket, _, prefix = rest.partition("/")
        if scheme != "s3" or not sep or not bucket:
            raise CatalogError(f"catalog store {uri!r}: expected s3://bucket[/prefix]")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, max_pool_connections=max_pool,
                        retries={"max_attempts": 2, "mode": "standard"})
        self.client = boto3.session.Session().client("s3", config=config)

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _call(self, what: str, fn, **kw):
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return fn(Bucket=self.bucket, **kw)
        except ClientError as exc:
            raise s3_error(exc, f"the catalog store: {what}") from None
        except BotoCoreError as exc:  # the endpoint and bucket go to the log, not to clients
            log.warning("catalog store %s: %s: %s", self.uri, what, exc)
            raise SourceUnavailable(f"the catalog store: {what}: store unreachable") from None

    def exists(self, key: str) -> bool:
        try:
            self._call(key, self.client.head_object, Key=key)
        except SourceNotFound:
            return False
        return True

    def get(self, key: str) -> bytes | None:
        try:
            return self._call(key, self.client.get_object, Key=key)["Body"].read()
        except SourceNotFound:
            return None

    def get_range(self, key: str, offset: int, size: int) -> bytes | None:
        try:
            return self._call(key, self.client.get_object, Key=key,
                              Range=f"bytes={offset}-{offset + size - 1}")["Body"].read()
        except SourceNotFound:
            return None

    def put(self, key: str, data: bytes) -> None:
        self._call(key, self.client.put_object, Key=key, Body=data)

    def put_if(self, key: str, data: bytes, etag: str | None = None) -> str:
        """A conditional PUT (S3's If-None-Match / If-Match): `key` is written only when it is
        absent (`etag` None) or still holds the object of that ETag. The new ETag; WriteConflict
        when the condition fails (another writer got there first)."""
        from botocore.exceptions import BotoCoreError, ClientError
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        try:
            return self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **condition)["ETag"]
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise WriteConflict(f"the catalog store: {key} was written by another writer") from None
            raise s3_error(exc, f"the catalog store: {key}") from None
        except BotoCoreError as exc:
            log.warning("catalog store %s: %s: %s", self.uri, key, exc)
            raise SourceUnavailable(f"the catalog store: {key}: store unreachable") from None

    def get_with_etag(self, key: str) -> tuple[bytes, str] | None:
        """(the object, its ETag), or None when absent."""
        try:
            got = self._call(key, self.client.get_object, Key=key)
        except SourceNotFound:
            return None
        return got["Body"].read(), got["ETag"]

    def delete(self, keys: list[str]) -> None:
        """Delete `keys` (a thousand a request; absent ones are no error)."""
        for i in range(0, len(keys), 1000):
            objects = [{"Key": k} for k in keys[i:i + 1000]]
            self._call("delete", self.client.delete_objects, Delete={"Objects": objects, "Quiet": True})

    def get_json(self, key: str) -> dict | None:
        raw = self.get(key)
        return None if raw is None else json.loads(raw)

    def put_json(self, key: str, doc: dict) -> None:
        self.put(key, json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())

    def list_after(self, prefix: str, start: str = "", stop: str | None = None) -> list[str]:
        """The keys under `prefix/` after `start` (and up to `stop`, inclusive), in order."""
        keys, token = [], None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = self._call(prefix, self.client.list_objects_v2, Prefix=self.key(prefix) + "/",
                              StartAfter=start, **extra)
            keys += [o["Key"] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if stop is not None and keys and keys[-1] > stop:
                return [k for k in keys if k <= stop]
            if not token:
                return keys

    def list_objects(self, prefix: str, start: str = "", etags: bool = False):
        """(key, last modified unix time, size) of every object under `prefix/` after `start`,
        in key order, a page (1,000) at a time: a listing that need not hold them all. With
        `etags`, (key, time, size, ETag)."""
        token = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = self._call(prefix, self.client.list_objects_v2, Prefix=self.key(prefix) + "/",
                              StartAfter=start, **extra)
            for o in page.get("Contents", []):
                got = (o["Key"], o["LastModified"].timestamp(), o["Size"])
                yield (*got, o.get("ETag")) if etags else got
            token = page.get("NextContinuationToken")
            if not token:
                return

    def modified(self, key: str) -> float | None:
        """When `key` was last written (unix time), or None when it is absent."""
        try:
            return self._call(key, self.client.head_object, Key=key)["LastModified"].timestamp()
        except SourceNotFound:
            return None

    def log_after(self, start: str) -> list[str]:
        """The change log's keys after `start`, in order (every page)."""
        return self.list_after("log", start)

    # -- the catalog's objects --------------------------------------------------------------
    def policy_key(self, adapter_id: str) -> str:
        return self.key("policies", f"{adapter_id}.json")

    def record_key(self, adapter_id: str, revision: str) -> str:
        return self.key("revisions", adapter_id, f"{revision}.json")

    def blob_key(self, checksum: str) -> str:
        return self.key("blobs", checksum)

    def policy(self, adapter_id: str) -> PolicyRecord | None:
        """The store's policy of `adapter_id`; None when it never had it (a deleted adapter's
        policy has no revisions)."""
        return self.policy_doc(adapter_id).policy

    def policy_doc(self, adapter_id: str) -> PolicyDoc:
        raw = self.get(self.policy_key(adapter_id))
        return PolicyDoc(None) if raw is None else parse_policy(raw)

    def put_segment(self, revisions: list[tuple[RevisionRecord, bytes]]) -> list[dict]:
        """The blobs of `revisions` end to end as one new segment object (a fresh key); the
        `placed` entry of each, in order: its record's fields, the segment and its offset."""
        segment = self.key("segments", uuid.uuid4().hex)
        placed, offset = [], 0
        for record, blob in revisions:
            placed.append({**{name: getattr(record, name) for name in record.__slots__},
                           "segment": segment, "offset": offset})
            offset += record.size
        self.put(segment, b"".join(blob for _, blob in revisions))
        return placed

    def put_policy(self, doc: PolicyDoc) -> None:
        self.put(self.policy_key(doc.policy.adapter_id), policy_bytes(doc))

    def locate(self, doc: PolicyDoc, revision: str) -> tuple[RevisionRecord | None, dict | None]:
        """(the record of `revision` of `doc`'s adapter, where its blob is in a segment, or None:
        under blobs/)."""
        placed = doc.placed.get(revision)
        if placed is None:
            return self.record(doc.policy.adapter_id, revision), None
        fields = {k: v for k, v in placed.items() if k not in ("segment", "offset")}
        return RevisionRecord(**fields), {"segment": placed["segment"], "offset": placed["offset"]}

    def record(self, adapter_id: str, revision: str) -> RevisionRecord | None:
        raw = self.get(self.record_key(adapter_id, revision))
        return None if raw is None else RevisionRecord.from_json(raw)

    def blob(self, record: RevisionRecord, where: dict | None = None) -> bytes:
        """`record`'s blob (from its segment when `where` says so), verified against its checksum
        and size (CorruptBlob otherwise)."""
        blob = self.get(self.blob_key(record.checksum)) if where is None else \
            self.get_range(where["segment"], where["offset"], record.size)
        if blob is None:
            raise CorruptBlob(f"{record.ref}: blob {record.checksum} is missing from the catalog store")
        if len(blob) != record.size or blob_checksum(blob) != record.checksum:
            raise CorruptBlob(f"{record.ref}: the blob in the catalog store fails its checksum; not cached")
        return blob
