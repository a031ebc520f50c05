"""The catalog's durable tier: one S3-compatible bucket prefix that every host's catalog caches.

`--catalog-store s3://bucket/prefix` keeps, under the prefix:

    blobs/<xxh3-128>                         a revision's blob, content-addressed and immutable
    revisions/<tenant>/<name>/<rev>.json      its revision record (immutable)
    policies/<tenant>/<name>.json             the adapter's policy record: revisions, promoted,
                                              previous, tags (small, rewritten on each change)
    log/<unix ns, 20 digits>-<host>-<n>.json  the change log: one entry per policy change

`StoreTier(store, catalog)` joins one host's LMDB catalog to it:

- publish: every write the catalog commits through its methods (put_revision, promote,
  rollback, tag: imports, materialize through them, training saves) calls `published(id)`
  (`Catalog.observers`), which uploads the revisions the store lacks (blob first, then the
  record) and, when the local promoted revision or tags differ from the store's, the merged
  policy (the revisions of both; promoted, previous and tags as the local write left them:
  last writer wins) and a log entry. A failed upload fails the write's call with 503 after
  the local commit; the call is idempotent, and re-running it publishes.
- fault in: `fault_in(id, rev)` copies a revision the local catalog lacks (the promoted one by
  default, or a revision id or tag) from the store: record, then blob verified against the
  record's xxh3-128 (a corrupt object is refused, CorruptBlob, and never written), and the
  store's promoted revision is promoted locally when it is the one copied.
- follow: `poll()` reads the log entries after its cursor and applies each to an adapter this
  host holds (faulting in the newly promoted revision when needed); adapters it does not hold
  are left to fault in when asked for, already at the store's state. `start()` polls every
  `poll_s` on a thread. Bound: a promote is served by every host within `poll_s` plus one
  listing and one blob download of its committing on the writer, given the writers' clocks
  agree within `skew_s` (the log is read from `skew_s` before the cursor; entries are applied once).

Writes a tier makes while replaying the store (fault-in, poll) are not published again.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from contextlib import contextmanager

from .errors import AdapterNotFound, CatalogError, CorruptBlob, RevisionNotFound, SourceNotFound, SourceUnavailable
from .fetchers import s3_error
from .format import blob_checksum
from .lru import BoundedLRU
from .records import PolicyRecord, RevisionRecord
from .store import Catalog

log = logging.getLogger("loraserve.catalog.store_s3")


class ObjectStore:
    """The keys of one `s3://bucket/prefix` (module doc) through boto3 (standard AWS config)."""

    def __init__(self, uri: str, timeout_s: float = 10.0) -> None:
        import boto3
        from botocore.config import Config
        scheme, sep, rest = uri.partition("://")
        bucket, _, prefix = rest.partition("/")
        if scheme != "s3" or not sep or not bucket:
            raise CatalogError(f"catalog store {uri!r}: expected s3://bucket[/prefix]")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                        retries={"max_attempts": 2, "mode": "standard"})
        self.client = boto3.session.Session().client("s3", config=config)

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _call(self, what: str, fn, **kw):
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return fn(Bucket=self.bucket, **kw)
        except ClientError as exc:
            raise s3_error(exc, f"{self.uri}: {what}") from None
        except BotoCoreError as exc:
            raise SourceUnavailable(f"{self.uri}: {what}: store unreachable ({exc})") from None

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

    def put(self, key: str, data: bytes) -> None:
        self._call(key, self.client.put_object, Key=key, Body=data)

    def log_after(self, start: str) -> list[str]:
        """The change log's keys after `start`, in order (every page)."""
        keys, token = [], None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = self._call("log", self.client.list_objects_v2, Prefix=self.key("log") + "/",
                              StartAfter=start, **extra)
            keys += [o["Key"] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not token:
                return keys

    # -- the catalog's objects --------------------------------------------------------------
    def policy(self, adapter_id: str) -> PolicyRecord | None:
        raw = self.get(self.key("policies", f"{adapter_id}.json"))
        return None if raw is None else PolicyRecord.from_json(raw)

    def record(self, adapter_id: str, revision: str) -> RevisionRecord | None:
        raw = self.get(self.key("revisions", adapter_id, f"{revision}.json"))
        return None if raw is None else RevisionRecord.from_json(raw)

    def blob(self, record: RevisionRecord) -> bytes:
        """`record`'s blob, verified against its checksum and size (CorruptBlob otherwise)."""
        blob = self.get(self.key("blobs", record.checksum))
        if blob is None:
            raise CorruptBlob(f"{record.ref}: blob {record.checksum} is missing from {self.uri}")
        if len(blob) != record.size or blob_checksum(blob) != record.checksum:
            raise CorruptBlob(f"{record.ref}: the blob in {self.uri} fails its checksum; not cached")
        return blob


class StoreTier:
    """One host's catalog joined to the store (module doc)."""

    def __init__(self, store: ObjectStore, catalog: Catalog, *, poll_s: float = 2.0, skew_s: float = 10.0) -> None:
        self.store, self.catalog = store, catalog
        self.poll_s, self.skew_s = poll_s, skew_s
        self.host = uuid.uuid4().hex[:12]
        self._replay = threading.local()
        self._sequence = 0
        self._cursor = ""  # the newest log key applied
        self._applied: BoundedLRU[str, bool] = BoundedLRU(65536)  # log keys within the skew window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        catalog.observers.append(self.published)

    @contextmanager
    def replaying(self):
        """Writes made inside come from the store: `published` skips them."""
        self._replay.on = True
        try:
            yield
        finally:
            self._replay.on = False

    # -- publish ---------------------------------------------------------------------------
    def published(self, adapter_id: str) -> None:
        """The local catalog committed a write to `adapter_id`: make the store agree (module doc)."""
        if getattr(self._replay, "on", False):
            return
        local = self.catalog.policy(adapter_id)
        remote = self.store.policy(adapter_id)
        known = set(remote.revisions) if remote is not None else set()
        for rev in local.revisions:
            if rev not in known:
                self._publish_revision(self.catalog.resolve(adapter_id, rev))
        if remote is not None and (remote.promoted, remote.tags) == (local.promoted, local.tags) \
                and known.issuperset(local.revisions):
            return
        merged = [*(remote.revisions if remote else []), *(r for r in local.revisions if r not in known)]
        policy = PolicyRecord(adapter_id, local.base_fingerprint, local.rank, list(local.targets), merged,
                              local.promoted, local.previous, dict(local.tags), local.created, time.time())
        self.store.put(self.store.key("policies", f"{adapter_id}.json"), policy.to_json())
        self._log(adapter_id)

    def _publish_revision(self, record: RevisionRecord) -> None:
        blob_key = self.store.key("blobs", record.checksum)
        if not self.store.exists(blob_key):
            self.store.put(blob_key, self.catalog.read_blob(record))
        self.store.put(self.store.key("revisions", record.adapter_id, f"{record.revision}.json"), record.to_json())

    def _log(self, adapter_id: str) -> None:
        self._sequence += 1
        name = f"{time.time_ns():020d}-{self.host}-{self._sequence:08d}.json"
        self.store.put(self.store.key("log", name), json.dumps({"adapter_id": adapter_id}).encode())

    # -- fault in --------------------------------------------------------------------------
    def fault_in(self, adapter_id: str, revision: str | None = None) -> RevisionRecord:
        """Copy `adapter_id@revision` (default: the promoted one; a tag resolves) from the store
        into the local catalog; AdapterNotFound / RevisionNotFound when the store lacks it."""
        remote = self.store.policy(adapter_id)
        if remote is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} not found in {self.store.uri}")
        rev = remote.promoted if revision is None else remote.tags.get(revision, revision)
        if rev is None or rev not in remote.revisions:
            raise RevisionNotFound(f"adapter {adapter_id!r} has no revision {revision or 'promoted'!r} in {self.store.uri}")
        with self.replaying():
            self._copy(remote, rev)
            self._follow(remote)
        return self.catalog.resolve(adapter_id, rev)

    def _copy(self, remote: PolicyRecord, rev: str) -> None:
        try:
            self.catalog.resolve(remote.adapter_id, rev)
            return  # held already
        except (AdapterNotFound, RevisionNotFound):
            pass
        record = self.store.record(remote.adapter_id, rev)
        if record is None:
            raise CorruptBlob(f"{remote.adapter_id}@{rev}: the store's policy names it, its record is missing")
        blob = self.store.blob(record)
        self.catalog.put_revision(remote.adapter_id, blob, revision=rev, promote=False, source=record.source)

    def _follow(self, remote: PolicyRecord) -> None:
        """Promote locally what the store promotes, and copy its tags, for revisions held here."""
        local = self.catalog.policy(remote.adapter_id)
        if remote.promoted is not None and local.promoted != remote.promoted:
            self._copy(remote, remote.promoted)
            self.catalog.promote(remote.adapter_id, remote.promoted)
        held = set(self.catalog.policy(remote.adapter_id).revisions)
        for tag, rev in remote.tags.items():
            if rev in held and local.tags.get(tag) != rev:
                self.catalog.tag(remote.adapter_id, tag, rev)

    # -- follow ----------------------------------------------------------------------------
    def poll(self) -> int:
        """Apply the log entries written since the last poll (module doc); how many changed an
        adapter held here."""
        keys = self.store.log_after(self._window_start())
        applied = 0
        for key in keys:
            if self._applied.get(key) is not None:
                continue
            self._applied.put(key, True)
            self._cursor = max(self._cursor, key)
            if f"-{self.host}-" in key.rpartition("/")[2]:
                continue  # this host's own write
            raw = self.store.get(key)
            adapter_id = json.loads(raw).get("adapter_id") if raw else None
            if adapter_id is not None and self._holds(adapter_id):
                remote = self.store.policy(adapter_id)
                if remote is not None:
                    with self.replaying():
                        self._follow(remote)
                    applied += 1
        self._save_cursor()
        return applied

    def _holds(self, adapter_id: str) -> bool:
        try:
            self.catalog.policy(adapter_id)
        except AdapterNotFound:
            return False
        return True

    def _window_start(self) -> str:
        """The log key to list after: `skew_s` before the cursor (on the first poll: the saved
        cursor, else now)."""
        if not self._cursor:
            self._cursor = self._load_cursor() or self._log_key(time.time_ns())
        cursor_ns = int(self._cursor.rpartition("/")[2][:20])
        return self._log_key(max(0, cursor_ns - int(self.skew_s * 1e9)))

    def _log_key(self, ns: int) -> str:
        return self.store.key("log", f"{ns:020d}")

    @property
    def _cursor_file(self):
        return self.catalog.path / "store-cursor.json"

    def _load_cursor(self) -> str:
        try:
            return json.loads(self._cursor_file.read_text())["cursor"]
        except (OSError, ValueError, KeyError):
            return ""

    def _save_cursor(self) -> None:
        """Kept beside the shards, so a restarted host reads the changes it missed while down."""
        tmp = self._cursor_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"store": self.store.uri, "cursor": self._cursor}))
        tmp.replace(self._cursor_file)

    def start(self) -> None:
        """Poll every `poll_s` seconds on a daemon thread until `close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loraserve-store-poll", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except CatalogError as exc:  # the store is down: resident and cached adapters serve on
                log.warning("catalog store poll failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 30)
        if self.published in self.catalog.observers:
            self.catalog.observers.remove(self.published)
