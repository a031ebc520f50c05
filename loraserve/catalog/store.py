"""The adapter catalog: a directory of LMDB shards holding policy records and immutable revisions.

    DIR/catalog.json      {"format": "loraserve.catalog.v1", "shards": S}
    DIR/shard-000 ...     one LMDB env per shard; adapter -> shard by xxh3_64(id) % S

A policy record and all its revisions live in one shard, so every operation on one adapter
is a single LMDB transaction: a crash leaves each shard consistent. Readers (other threads or
processes) see committed state only and never block writers.

A shard whose files are damaged or gone raises ShardUnavailable (503) for its own adapters only;
a listing, which needs every shard, fails with it rather than answer partially.
`degraded_shards()` says which shards are unavailable without touching any LMDB page.

`resolve` results are cached per shard write generation (`ResolveCache`): every request names
an adapter, and a hot one is resolved thousands of times a second between writes.

Every transaction body is a module-level function (bound with `functools.partial`), so it can
be pickled: an `IsolatedCatalog` (module `isolated`) runs the same bodies in its shard hosts.
"""
from __future__ import annotations

import functools
import heapq
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import AdapterNotFound, CatalogError, CorruptBlob, RevisionNotFound, ShardUnavailable
from .format import blob_checksum
from .ids import validate_adapter_id, validate_revision
from .lru import BoundedLRU
from .records import PolicyRecord, RevisionRecord
from .shards import CATALOG_META, Shard, ShardOptions, shard_of
from .writes import (promote_in_txn, put_revision_in_txn, read_policy, read_revision, rewrite_blob_in_txn,
                     rollback_in_txn, tag_in_txn)

CATALOG_FORMAT = "loraserve.catalog.v1"


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _numbers(indices: list[int], shown: int = 16) -> str:
    """`3, 7, 12` (and how many more beyond `shown`)."""
    more = len(indices) - shown
    return ", ".join(map(str, indices[:shown])) + (f" and {more} more" if more > 0 else "")


def _verified(txn, dbs, record: RevisionRecord) -> memoryview:
    """The stored blob of `record` as a view into the LMDB map (valid inside `txn` only), after
    the checks every read makes: present, `record.size` bytes, `record.checksum`. CorruptBlob if not."""
    view = txn.get(record.ref.encode(), db=dbs.blob)
    if view is None:
        raise CorruptBlob(f"{record.ref}: blob missing")
    if len(view) != record.size:
        raise CorruptBlob(f"{record.ref}: blob has {len(view)} bytes, record says {record.size} (truncated)")
    if blob_checksum(view) != record.checksum:
        raise CorruptBlob(f"{record.ref}: checksum mismatch, blob is corrupt")
    return view


def _blob_bytes(txn, dbs, record: RevisionRecord) -> bytes:
    return bytes(_verified(txn, dbs, record))


def verified_blobs(txn, dbs, records: Sequence[RevisionRecord]) -> list[memoryview | CorruptBlob]:
    """`_verified` of each record, or its CorruptBlob (the views are valid inside `txn` only)."""
    out: list[memoryview | CorruptBlob] = []
    for record in records:
        try:
            out.append(_verified(txn, dbs, record))
        except CorruptBlob as e:
            out.append(e)
    return out


def _copied_blobs(txn, dbs, records: Sequence[RevisionRecord]) -> list[bytearray | CorruptBlob]:
    return [v if isinstance(v, CorruptBlob) else bytearray(v) for v in verified_blobs(txn, dbs, records)]


def lookup_revision(txn, dbs, adapter_id: str, revision: str | None) -> tuple[int, RevisionRecord]:
    """(the txn's id, the revision record `revision` names: a revision id, a tag or, when None,
    the promoted one); AdapterNotFound / RevisionNotFound."""
    policy = read_policy(txn, dbs, adapter_id)
    if policy is None:
        raise AdapterNotFound(f"adapter {adapter_id!r} not found")
    rev = revision if revision is not None else policy.promoted
    if rev is None:
        raise RevisionNotFound(f"adapter {adapter_id!r} has no promoted revision")
    rev = rev if rev in policy.revisions else policy.tags.get(rev)
    if rev is None:
        raise RevisionNotFound(f"adapter {adapter_id!r} has no revision or tag {revision!r}")
    return txn.id(), read_revision(txn, dbs, adapter_id, rev)


def lookup_carrying(txn, dbs, adapter_id: str, revision: str | None,
                    carry_bytes: int) -> tuple[int, RevisionRecord, bytes | None]:
    """`lookup_revision`, and the revision's blob in the same transaction when it is at most
    `carry_bytes` long: verified as every read verifies it (`_verified`), else None (a blob
    that fails its checks is left to the page-in, which reports it, or heals it)."""
    read_at, record = lookup_revision(txn, dbs, adapter_id, revision)
    if carry_bytes <= 0 or record.size > carry_bytes:
        return read_at, record, None
    try:
        return read_at, record, bytes(_verified(txn, dbs, record))
    except CorruptBlob:
        return read_at, record, None


def _scan_policies(txn, dbs, first: bytes, count: int, prefix: bytes) -> list[tuple[bytes, bytes]]:
    """Up to `count` (id, policy JSON) pairs from key `first` on, while ids start with `prefix`."""
    out = []
    cur = txn.cursor(db=dbs.policy)
    if cur.set_range(first):
        for k, v in cur:
            if len(out) >= count or not bytes(k).startswith(prefix):
                break
            out.append((bytes(k), bytes(v)))
    return out


def read_catalog_meta(path: str | Path) -> dict:
    """`catalog.json` of a catalog dir; CatalogError if missing or not ours."""
    meta_path = Path(path) / CATALOG_META
    if not meta_path.exists():
        raise CatalogError(f"{path}: not a catalog (no catalog.json); create one with `loraserve catalog init`")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != CATALOG_FORMAT or int(meta.get("shards", 0)) < 1:
        raise CatalogError(f"{meta_path}: unknown catalog format {meta.get('format')!r}")
    return meta


class ResolveCache:
    """`Catalog.resolve` answers, each tagged with the write generation of the shard it was read
    from: the id of the last LMDB write transaction committed to that shard (by any process)
    when it was read. An answer is served again only while that id has not moved, so any write
    to the shard (a new revision, promote, rollback, tag, a sync's deletes, here or in another
    process) makes its cached answers stale at once: a reader never sees a revision the
    catalog no longer serves. A hit costs the shard's health check and a read of its meta
    page, no transaction and no record decoding (~2.5x cheaper than a read; bench/RESULTS.md).

    Bounded LRU of `capacity` answers; thread-safe. Records are shared between callers, as the
    catalog never changes a revision record once written: treat them as read-only.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._answers: BoundedLRU[tuple[str, str | None], tuple[int, RevisionRecord]] = BoundedLRU(capacity)

    @property
    def capacity(self) -> int:
        return self._answers.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._answers.capacity = value

    def get(self, key: tuple[str, str | None], generation: int) -> RevisionRecord | None:
        hit = self._answers.get_if(key, lambda answer: answer[0] == generation)
        return None if hit is None else hit[1]

    def put(self, key: tuple[str, str | None], generation: int, record: RevisionRecord) -> None:
        self._answers.put(key, (generation, record))

    def clear(self) -> None:
        self._answers.clear()

    def __len__(self) -> int:
        return len(self._answers)


class Catalog:
    """Sharded adapter store. Thread-safe for reads; writes to one shard serialize in LMDB."""

    def __init__(self, path: str | Path, readonly: bool = False, options: ShardOptions | None = None) -> None:
        self.path = Path(path)
        self.shards = int(read_catalog_meta(self.path)["shards"])
        self.readonly = readonly
        opts = options or ShardOptions(readonly=readonly)
        self._shards = [Shard(self.path, i, opts) for i in range(self.shards)]
        self._checked_at = float("-inf")  # monotonic time of the last full health check
        self.resolved = ResolveCache()
        # called with the adapter id after each write committed through the methods below (the
        # durable tier publishes it: store_s3.StoreTier); an observer's error fails the call
        self.observers: list[Callable[[str], None]] = []
        # called with (adapter id, revision id, blob) before a write that names its revision
        # (a training save); an error refuses the write (store_s3.StoreTier.named_revision)
        self.before_named: list[Callable[[str, str, bytes], None]] = []

    @classmethod
    def create(cls, path: str | Path, shards: int = 100, options: ShardOptions | None = None) -> Catalog:
        """Create a catalog dir (idempotent when it exists with the same shard count)."""
        if not 1 <= shards <= 4096:
            raise CatalogError(f"shard count must be in 1..4096, got {shards}")
        path = Path(path)
        if (path / CATALOG_META).exists():
            existing = int(read_catalog_meta(path)["shards"])
            if existing != shards:
                raise CatalogError(f"{path}: already a catalog with {existing} shards, not {shards}")
            return cls(path, options=options)
        path.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(path / CATALOG_META, {"format": CATALOG_FORMAT, "shards": shards})
        return cls(path, options=options)

    @classmethod
    def open(cls, path: str | Path, readonly: bool = False, options: ShardOptions | None = None) -> Catalog:
        return cls(path, readonly=readonly, options=options)

    def shard_index(self, adapter_id: str) -> int:
        return shard_of(adapter_id, self.shards)

    def shard(self, index: int) -> Shard:
        return self._shards[index]

    def _shard_for(self, adapter_id: str) -> Shard:
        return self._shards[shard_of(validate_adapter_id(adapter_id), self.shards)]

    # -- reads ---------------------------------------------------------------------------
    def policy(self, adapter_id: str) -> PolicyRecord:
        """The adapter's policy record; AdapterNotFound if there is none."""
        found = self._shard_for(adapter_id).read(functools.partial(read_policy, adapter_id=adapter_id))
        if found is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} not found")
        return found

    def resolve(self, adapter_id: str, revision: str | None = None) -> RevisionRecord:
        """Revision record of `revision` (a revision id or tag), or of the promoted one when None.

        Served from `resolved` while the shard has seen no write since it was read there (see
        ResolveCache); the shard's health is checked either way."""
        if revision is not None:
            validate_revision(revision)
        shard = self._shard_for(adapter_id)
        key = (adapter_id, revision)
        generation = shard.generation()
        if generation is not None:
            cached = self.resolved.get(key, generation)
            if cached is not None:
                return cached

        lookup = functools.partial(lookup_revision, adapter_id=adapter_id, revision=revision)
        found = shard.read(lookup, checked=generation is not None)  # generation() just checked it
        if found is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} not found")
        read_at, record = found
        self.resolved.put(key, read_at, record)
        return record

    def read_blob(self, record: RevisionRecord) -> bytes:
        """The revision's blob, verified against `record.size` and `record.checksum` before the copy out."""
        blob = self._shard_for(record.adapter_id).read(functools.partial(_blob_bytes, record=record))
        if blob is None:
            raise CorruptBlob(f"{record.ref}: shard missing")
        return blob

    def read_blobs(self, records: Sequence[RevisionRecord]) -> list[bytearray | Exception]:
        """The blobs of many revisions in one read transaction per shard (a page-in batch).

        Entry `i` is record `i`'s blob, verified exactly as `read_blob` verifies it, or the error
        `read_blob` would raise for it (CorruptBlob, ShardUnavailable, ...): a bad blob or an
        unavailable shard fails its own entries only. One transaction per shard pays the shard's
        health check (`Shard.read`) and the transaction setup once for all its records. A blob
        is a `bytearray`, the one copy out of the LMDB map: writable, so `layout.load_revision`
        can make the tensors views of it rather than copy it again.
        """
        out: list[bytearray | Exception | None] = [None] * len(records)
        by_shard: dict[int, list[int]] = {}
        for i, record in enumerate(records):
            try:
                by_shard.setdefault(self.shard_index(validate_adapter_id(record.adapter_id)), []).append(i)
            except CatalogError as e:
                out[i] = e

        found = self._shards_blobs({index: [records[i] for i in positions] for index, positions in by_shard.items()})
        for index, positions in by_shard.items():
            blobs = found[index]
            for n, i in enumerate(positions):
                if blobs is None:
                    out[i] = CorruptBlob(f"{records[i].ref}: shard missing")
                else:
                    out[i] = blobs if isinstance(blobs, Exception) else blobs[n]
        return out

    def _shards_blobs(self, by_shard: dict[int, list[RevisionRecord]]) -> dict[int, list | Exception | None]:
        """Per shard: the verified blobs (or CorruptBlob) of its records, in one read txn; None
        when the shard was never written; the exception when the shard failed as a whole."""
        found: dict[int, list | Exception | None] = {}
        for index, shard_records in by_shard.items():
            try:
                found[index] = self._shards[index].read(functools.partial(_copied_blobs, records=shard_records))
            except Exception as e:  # the shard's records fail with it; other shards go on
                found[index] = e
        return found

    def list(self, prefix: str = "", limit: int = 100, after: str | None = None) -> list[PolicyRecord]:
        """Policy records whose id starts with `prefix`, in id order, after id `after`, at most `limit`.

        A merge of the shards' sorted key ranges that reads about `limit` records in all, not
        `limit` from every shard: each shard is asked for its share (ids hash evenly over the
        shards) plus slack, and asked again, for twice as many, only while its last key read
        could still precede the page's last (so a page of a 1,000,000-adapter catalog decodes
        ~`limit` records where it decoded 100 x `limit`). Only the page's records are decoded."""
        if limit < 0:
            raise CatalogError("limit must be >= 0")
        if limit == 0:
            return []
        start = max(prefix, after + "\0") if after is not None else prefix
        pfx = prefix.encode()

        def scan(first: bytes, count: int) -> functools.partial:
            return functools.partial(_scan_policies, first=first, count=count, prefix=pfx)

        asked = min(limit, 2 * -(-limit // len(self._shards)) + 8)
        got = self._read_every({i: scan(start.encode(), asked) for i in range(self.shards)}, "listing")
        want = dict.fromkeys(got, asked)  # how many each shard was last asked for
        tail = {i: len(r) == asked for i, r in got.items()}  # its last read filled the ask: more may follow
        while True:
            page = heapq.nsmallest(limit, (kv for r in got.values() for kv in r))
            cutoff = page[-1][0] if len(page) == limit else None
            more = [i for i in got if tail[i] and (cutoff is None or got[i][-1][0] < cutoff)]
            if not more:
                return [PolicyRecord.from_json(v) for _, v in page]
            for i in more:
                want[i] = min(limit, 2 * want[i])
            extra = self._read_every({i: scan(got[i][-1][0] + b"\0", want[i]) for i in more}, "listing")
            for i in more:
                got[i] = got[i] + extra[i]
                tail[i] = len(extra[i]) == want[i]

    def stats(self) -> dict:
        """Totals `{"adapters", "revisions", "shards", "bytes", "disk_bytes"}` plus `per_shard` rows."""
        per = self._every_shard(lambda s: [dict(shard=s.index, **s.stats())], "stats")
        total = {k: sum(p[k] for p in per) for k in ("adapters", "revisions", "bytes", "disk_bytes")}
        return {**total, "shards": self.shards, "per_shard": per}

    def _every_shard(self, fn, what: str, indices: list[int] | None = None) -> list:
        """Concatenated `fn(shard)` over all shards (or those of `indices`); one ShardUnavailable
        naming every unavailable shard."""
        out, down = [], []
        for s in self._shards if indices is None else [self._shards[i] for i in indices]:
            try:
                out.extend(fn(s))
            except ShardUnavailable:
                down.append(s.index)
        if down:
            raise self._needs_every(what, down)
        return out

    def _read_every(self, bodies: dict[int, functools.partial], what: str) -> dict[int, list]:
        """`{shard: its read of bodies[shard]}` (`[]` for a shard never written); one
        ShardUnavailable naming every unavailable shard."""
        return dict(self._every_shard(lambda s: [(s.index, s.read(bodies[s.index], default=[]))], what,
                                      list(bodies)))

    def _needs_every(self, what: str, down: list[int]) -> ShardUnavailable:
        reason = self._shards[down[0]].fault or "damaged"
        return ShardUnavailable(f"catalog {what} needs every shard; unavailable: {_numbers(down)} "
                                f"(shard {down[0]}: {reason})", down)

    def degraded(self, max_age: float = 1.0) -> dict[int, str]:
        """Unavailable shards and why: the verdicts of the latest checks, all rechecked first
        when the last full check is older than `max_age` seconds. Reads no LMDB page."""
        now = time.monotonic()
        if now - self._checked_at >= max_age:
            self._checked_at = now
            for s in self._shards:
                s.diagnose()
        return {s.index: s.fault for s in self._shards if s.fault}

    def degraded_shards(self, max_age: float = 1.0) -> list[int]:
        """Indices of the unavailable shards, ascending (see `degraded`)."""
        return sorted(self.degraded(max_age))

    # -- writes --------------------------------------------------------------------------
    def put_revision(
        self, adapter_id: str, blob: bytes, *, revision: str | None = None, promote: bool = True, source: str = ""
    ) -> RevisionRecord:
        """Store a new immutable revision (default id `r{n+1}`); optionally promote it. Idempotent for equal bytes."""
        if revision is not None:
            validate_revision(revision)
            for check in self.before_named:
                check(adapter_id, revision, blob)
        now = time.time()
        return self._wrote(adapter_id, self._shard_for(adapter_id).write(
            functools.partial(put_revision_in_txn, adapter_id=adapter_id, blob=blob, revision=revision,
                              promote=promote, source=source, now=now),
            reserve=len(blob),
        ))

    def rewrite_blob(self, record: RevisionRecord, blob: bytes) -> None:
        """Replace `record`'s stored blob with `blob`, its verified bytes (a repair: store_heal)."""
        self._shard_for(record.adapter_id).write(
            functools.partial(rewrite_blob_in_txn, record=record, blob=blob), reserve=len(blob))

    def promote(self, adapter_id: str, revision: str) -> PolicyRecord:
        """Make `revision` (id or tag) the served one; the old one becomes `previous`."""
        validate_revision(revision)
        now = time.time()
        return self._wrote(adapter_id, self._shard_for(adapter_id).write(
            functools.partial(promote_in_txn, adapter_id=adapter_id, revision=revision, now=now)))

    def rollback(self, adapter_id: str) -> PolicyRecord:
        """Promote `previous` again (the rolled-back revision becomes `previous`)."""
        now = time.time()
        return self._wrote(adapter_id, self._shard_for(adapter_id).write(
            functools.partial(rollback_in_txn, adapter_id=adapter_id, now=now)))

    def tag(self, adapter_id: str, tag: str, revision: str) -> PolicyRecord:
        """Point tag `tag` at `revision`; a tag resolves like a revision id."""
        validate_revision(tag, "tag")
        validate_revision(revision)
        now = time.time()
        return self._wrote(adapter_id, self._shard_for(adapter_id).write(
            functools.partial(tag_in_txn, adapter_id=adapter_id, tag=tag, revision=revision, now=now)))

    def _wrote(self, adapter_id: str, result):
        for observe in self.observers:
            observe(adapter_id)
        return result

    def sync(self) -> None:
        for s in self._shards:
            s.sync()

    def close(self) -> None:
        self.resolved.clear()
        for s in self._shards:
            s.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
