"""The catalog's durable tier: one S3-compatible bucket prefix that every host's catalog caches.

`--catalog-store s3://bucket/prefix` keeps, under the prefix:

    blobs/<xxh3-128>                         a revision's blob, content-addressed and immutable
    revisions/<tenant>/<name>/<rev>.json      its revision record (immutable)
    policies/<tenant>/<name>.json             the adapter's policy record: revisions, promoted,
                                              previous, tags (small, rewritten on each change)
    log/<unix ns, 20 digits>-<host>-<n>.json  the change log: one entry per policy change

`StoreTier(store, catalog)` joins one host's LMDB catalog to it:

- publish: every write this process's catalog commits through its methods (put_revision,
  promote, rollback, tag) calls `published(id)` (`Catalog.observers`), which uploads the
  revisions the store lacks (blob first, then the record) and, when the local promoted revision
  or tags differ from the store's, the merged policy (the revisions of both; promoted, previous
  and tags as the local write left them: last writer wins) and, when the store had the adapter
  already, a log entry. A failed upload fails the write's call with 503 after the local commit;
  the call is idempotent, and re-running it publishes. `publish_catalog` (catalog.store_bulk)
  publishes a whole catalog.
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

- bound: with `cache_mb` (`s3://bucket/prefix?cache_mb=N`), the adapters this tier faulted in or
  published are kept in least-recently-used order (a request's resolve: `touch`), and
  while their bytes exceed the bound the least recent adapter is dropped from the local catalog
  (after each fault-in and each poll; so the bound is exceeded by at most what one poll interval
  fetches). Only an adapter the store holds exactly as here (every revision, the promoted one,
  the tags) is dropped, with no tombstone: a later request faults it in again. Its records go at
  once and its blobs `blob_grace_s` later, so a page-in that resolved it just before still reads
  its blob. Adapters this process has not seen since it started are not counted or dropped.

Writes a tier makes while replaying the store (fault-in, poll) are not published again.
"""
from __future__ import annotations

import functools
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
from .shards import add_blob_bytes
from .store import Catalog
from .writes import read_policy

log = logging.getLogger("loraserve.catalog.store_s3")
TRACKED_MAX = 1 << 20  # adapters whose recency a tier keeps (beyond: the least recent untracked)


def parse_store_uri(uri: str) -> tuple[str, int | None]:
    """`s3://bucket/prefix[?cache_mb=N]` -> (the store's URI, the local bound in MiB or None)."""
    base, sep, query = uri.partition("?")
    if not sep:
        return uri, None
    key, eq, value = query.partition("=")
    if key != "cache_mb" or not eq or not value.isdigit() or int(value) < 1:
        raise CatalogError(f"catalog store {uri!r}: the one option is ?cache_mb=N (N >= 1 MiB)")
    return base, int(value)


def drop_records_in_txn(txn, dbs, adapter_id: str) -> list[str]:
    """Remove `adapter_id`'s policy and revision records, with no tombstone (the store keeps
    them); their bytes leave the shard's count now. The refs whose blobs `drop_blobs_in_txn`
    removes later."""
    policy = read_policy(txn, dbs, adapter_id)
    if policy is None:
        return []
    refs, freed = [], 0
    for rev in policy.revisions:
        key = f"{adapter_id}@{rev}".encode()
        raw = txn.get(key, db=dbs.revision)
        if raw is not None:
            freed += RevisionRecord.from_json(raw).size
            txn.delete(key, db=dbs.revision)
            refs.append(key.decode())
    txn.delete(adapter_id.encode(), db=dbs.policy)
    add_blob_bytes(txn, dbs, -freed)
    return refs


def drop_blobs_in_txn(txn, dbs, refs: list[str]) -> int:
    """Delete the blobs of `refs` that no record names again (faulted in since: kept)."""
    dropped = 0
    for ref in refs:
        key = ref.encode()
        if txn.get(key, db=dbs.revision) is None and txn.delete(key, db=dbs.blob):
            dropped += 1
    return dropped


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

    def __init__(self, store: ObjectStore, catalog: Catalog, *, poll_s: float = 2.0, skew_s: float = 10.0,
                 max_bytes: int | None = None, blob_grace_s: float = 60.0) -> None:
        self.store, self.catalog = store, catalog
        self.poll_s, self.skew_s = poll_s, skew_s
        self.max_bytes = max_bytes  # the bound of the counted local bytes (`cache_mb`); None: none
        self.blob_grace_s = blob_grace_s
        self._seen: BoundedLRU[str, int] = BoundedLRU(TRACKED_MAX)  # adapter id -> its local bytes
        self._seen_bytes = 0
        self._bytes_lock = threading.Lock()
        self._doomed: list[tuple[float, str, list[str]]] = []  # (due, adapter id, refs): blobs to drop
        self.dropped = 0  # adapters dropped from the local catalog
        self.host = uuid.uuid4().hex[:12]
        self._replay = threading.local()
        self._sequence = 0
        self._cursor = ""  # the newest log key applied
        self._saved = ""  # the cursor store-cursor.json holds
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
    def published(self, adapter_id: str) -> bool:
        """The local catalog committed a write to `adapter_id`: make the store agree (module doc).
        Whether anything was uploaded. A new adapter needs no log entry: no host holds it yet."""
        if getattr(self._replay, "on", False):
            return False
        local = self.catalog.policy(adapter_id)
        remote = self.store.policy(adapter_id)
        known = set(remote.revisions) if remote is not None else set()
        for rev in local.revisions:
            if rev not in known:
                self._publish_revision(self.catalog.resolve(adapter_id, rev))
        if remote is not None and (remote.promoted, remote.tags) == (local.promoted, local.tags) \
                and known.issuperset(local.revisions):
            return False
        merged = [*(remote.revisions if remote else []), *(r for r in local.revisions if r not in known)]
        policy = PolicyRecord(adapter_id, local.base_fingerprint, local.rank, list(local.targets), merged,
                              local.promoted, local.previous, dict(local.tags), local.created, time.time())
        self.store.put(self.store.key("policies", f"{adapter_id}.json"), policy.to_json())
        if remote is not None:
            self._log(adapter_id)
        self._track(adapter_id)
        return True

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
        self._untrack(adapter_id)  # never dropped by a concurrent evict while it comes in
        with self.replaying():
            self._copy(remote, rev)
            self._follow(remote)
        record = self.catalog.resolve(adapter_id, rev)
        self._track(adapter_id)
        self.evict(keep=adapter_id)
        return record

    def _copy(self, remote: PolicyRecord, rev: str) -> None:
        try:
            self.catalog.resolve(remote.adapter_id, rev)
            return  # held already
        except (AdapterNotFound, RevisionNotFound):
            pass
        record = self.store.record(remote.adapter_id, rev)
        if record is None:
            raise CorruptBlob(f"{remote.adapter_id}@{rev}: the store's policy names it, its record is missing")
        blob = self.store.blob(record)  # promoted in the same write when the store promotes it
        self.catalog.put_revision(remote.adapter_id, blob, revision=rev, promote=rev == remote.promoted,
                                  source=record.source)

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
            saved = json.loads(self._cursor_file.read_text())
        except (OSError, ValueError):
            return ""
        return saved.get("cursor", "") if saved.get("store") == self.store.uri else ""  # another store's

    def _save_cursor(self) -> None:
        """Kept beside the shards, so a restarted host reads the changes it missed while down."""
        if self._cursor == self._saved:
            return
        self._saved = self._cursor
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
                self.evict()
            except CatalogError as exc:  # the store is down: resident and cached adapters serve on
                log.warning("catalog store poll failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 30)
        if self.published in self.catalog.observers:
            self.catalog.observers.remove(self.published)

    # -- bound -----------------------------------------------------------------------------
    def touch(self, adapter_id: str) -> None:
        """A request resolved `adapter_id`: the most recently used (when this tier counts it)."""
        self._seen.get(adapter_id)

    def _untrack(self, adapter_id: str) -> None:
        with self._bytes_lock:
            self._seen_bytes -= self._seen.pop(adapter_id) or 0

    def _track(self, adapter_id: str) -> None:
        """Count `adapter_id`'s local bytes, as the most recently used."""
        try:
            local = self.catalog.policy(adapter_id)
        except AdapterNotFound:
            return
        size = sum(self.catalog.resolve(adapter_id, rev).size for rev in local.revisions)
        with self._bytes_lock:
            self._seen_bytes += size - (self._seen.pop(adapter_id) or 0)
            for _, gone in self._seen.put(adapter_id, size):  # past TRACKED_MAX: no longer counted
                self._seen_bytes -= gone

    def evict(self, keep: str | None = None) -> int:
        """Drop least recently used adapters until the counted bytes fit `max_bytes` (module doc),
        never `keep`; then the blobs whose grace is over. How many adapters were dropped."""
        dropped = 0
        while self.max_bytes is not None and self._seen_bytes > self.max_bytes:
            with self._bytes_lock:
                oldest = self._seen.pop_oldest()
                if oldest is None:
                    break
                self._seen_bytes -= oldest[1]
                if oldest[0] == keep:  # the only one left: the bound cannot be met without it
                    self._seen.put(keep, oldest[1])
                    self._seen_bytes += oldest[1]
                    break
            dropped += self._drop(oldest[0])
        self._drop_due_blobs()
        self.dropped += dropped
        return dropped

    def _drop(self, adapter_id: str) -> int:
        """Drop `adapter_id` locally when the store holds it exactly as here; 1 if dropped."""
        try:
            local = self.catalog.policy(adapter_id)
        except AdapterNotFound:
            return 0
        remote = self.store.policy(adapter_id)
        if remote is None or not set(local.revisions) <= set(remote.revisions) or \
                (local.promoted, local.tags) != (remote.promoted, remote.tags):
            return 0  # not (yet) published as it is here: keep it
        shard = self.catalog.shard(self.catalog.shard_index(adapter_id))
        refs = shard.write(functools.partial(drop_records_in_txn, adapter_id=adapter_id))
        with self._bytes_lock:
            self._doomed.append((time.monotonic() + self.blob_grace_s, adapter_id, refs))
        return 1

    def _drop_due_blobs(self) -> None:
        now = time.monotonic()
        with self._bytes_lock:
            due = [d for d in self._doomed if d[0] <= now]
            self._doomed = [d for d in self._doomed if d[0] > now]
        for _, adapter_id, refs in due:
            shard = self.catalog.shard(self.catalog.shard_index(adapter_id))
            shard.write(functools.partial(drop_blobs_in_txn, refs=refs))
