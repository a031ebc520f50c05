"""`IsolatedCatalog`: the catalog of a serving process, whose shards are mapped by shard hosts.

A damaged, truncated, replaced or unreadable shard must fail only the requests that need it,
never the process: a read of a garbage LMDB page is a signal, not an exception, so the serving
process (API server, engine core, Ray ingress) maps no shard at all. Shard `i` is read by host
`i % hosts` (module `shardhost`), a small process that does the LMDB work one request at a time,
and written by one writer host (so a read never queues behind a write); the public API is
`Catalog`'s, answer for answer, so callers do not change. A page-in batch is one exchange per
host, all hosts at once.

What stays in the serving process, with no LMDB page read:
- the shard's health and write generation (`shardfile.DataFileWatch`: a stat and a `pread` of
  the meta pages): a resolve-cache hit costs that check and no host call, and a truncated,
  replaced or removed file answers 503 at once (`degraded()` lists it, so `/ready` names it);
- quarantine: when a host dies (or hangs past `timeout_s`, and is killed) the request in flight
  gets ShardUnavailable naming its shard, and that shard is quarantined: 503 at once for every
  request, listed by `degraded()`, while the other shards of the host go on (requests queued
  for them go to its replacement). LMDB itself reporting a damaged page on a read does the
  same. A prober thread reads a quarantined shard again in a probe host, a process of its own so
  a probe that dies or hangs again holds up no reader (`shardhost._probe`: every page of the
  record dbs, then the read that failed): after a backoff that doubles from
  `probe_backoff_s[0]` to `probe_backoff_s[1]`, or at once when the data file changes (it was
  restored), and so does the first request that finds it changed; the shard serves again when a
  probe reads it.

`open_for_serving` picks this class unless `LORASERVE_CATALOG_HOSTS=0` (the in-process
`Catalog`); a positive value sets the number of hosts (default: min(4, CPUs, shards)).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CatalogError, ShardUnavailable
from .records import RevisionRecord
from .shardfile import DATA_FILE, DataFileWatch
from .shardhost import REPLAYED, HostLost, ShardHost, call_hosts, child_pids, close_hosts, unwrap
from .shards import CATALOG_META, ShardOptions, shard_dirname
from .ids import validate_adapter_id, validate_revision
from .lru import BoundedLRU
from .store import Catalog, lookup_carrying

log = logging.getLogger("loraserve.catalog")
HOSTS_ENV = "LORASERVE_CATALOG_HOSTS"
PROBE_POLL_S = 0.1  # how often the prober looks at quarantined shards' files
CARRY_BYTES = 64 * 1024  # a blob up to this long is read with its record ahead (`carry_blobs`)
CARRIED_BLOBS = 256  # such blobs held for their requests, at most (16 MiB)


def open_for_serving(path: str | Path, readonly: bool = False) -> Catalog:
    """The catalog a serving process opens: an IsolatedCatalog, or with `LORASERVE_CATALOG_HOSTS=0`
    the in-process Catalog (whose damaged pages can end the process)."""
    hosts = os.environ.get(HOSTS_ENV, "").strip()
    if hosts == "0":
        return Catalog.open(path, readonly=readonly)
    return IsolatedCatalog(path, readonly=readonly, hosts=int(hosts) if hosts else None)


@dataclass(slots=True)
class Quarantine:
    """Why a shard answers 503 until a probe reads it, and when the next probe is due."""

    reason: str
    replay: tuple | None  # (op, payload) of the read that failed: the probe runs it again
    backoff: float
    due: float  # time.monotonic() of the next probe
    signature: tuple | None  # the data file's when last probed: a change makes a probe due


class HostedShard:
    """One shard of an IsolatedCatalog: the `Shard` interface `Catalog` uses (`index`, `fault`,
    `diagnose`, `generation`, `read`, `write`, `stats`, `sync`, `close`, `unavailable`), its LMDB
    work done by a shard host. Transaction bodies given to `read`/`write` must pickle
    (module-level functions, `functools.partial` of them) and return picklable values."""

    def __init__(self, catalog: IsolatedCatalog, index: int, host: ShardHost, writer: ShardHost) -> None:
        self.index = index
        self.path = catalog.path / shard_dirname(index)
        self.host, self.writer = host, writer
        self.quarantine: Quarantine | None = None
        self.file_fault: str | None = None
        self.watch = DataFileWatch(self.path / DATA_FILE, catalog.path / CATALOG_META)
        self._catalog = weakref.ref(catalog)  # the catalog owns its shards, not the reverse
        self.probing = threading.Lock()  # one probe of this shard at a time
        self._readonly = catalog.readonly

    @property
    def fault(self) -> str | None:
        """Why this shard cannot be used now (None: it can): quarantine, else the file check."""
        q = self.quarantine
        return q.reason if q is not None else self.file_fault

    def diagnose(self) -> str | None:
        """Check the data file now (a stat and a pread; never a page of the tree); `fault`."""
        self.check_file()
        return self.fault

    def check_file(self) -> int | None:
        """Check the data file now: `file_fault` set; the write generation (None: nothing yet)."""
        fault, generation = self.watch.check()
        if fault != self.file_fault:
            if fault:
                log.warning("catalog shard %d (%s) unavailable: %s", self.index, self.path, fault)
            else:
                log.info("catalog shard %d (%s) serves again", self.index, self.path)
        self.file_fault = fault
        return generation

    def generation(self) -> int | None:
        """The shard's write generation (see `Shard.generation`), from the meta pages by pread;
        None while nothing was committed. ShardUnavailable when the shard cannot be used. A
        quarantined shard whose file changed since its last probe (restored) is probed first,
        here: the request that finds it restored is served."""
        generation = self.check_file()
        q = self.quarantine
        if q is not None and self.file_fault is None and self.watch.signature() != q.signature:
            catalog = self._catalog()
            if catalog is not None:
                catalog.probe(self, q)
        if (fault := self.fault) is not None:
            raise self.unavailable(fault)
        return generation

    def unavailable(self, reason: str) -> ShardUnavailable:
        return ShardUnavailable(f"catalog shard {self.index} ({self.path.name}) is unavailable: {reason}",
                                [self.index])

    def read(self, fn, default=None, *, checked: bool = False):
        """`Shard.read` in the host: `fn(txn, dbs)` (picklable), or `default` for a shard never
        written. `checked`: `generation()` has just passed."""
        if not checked:
            self.generation()
        return self._call("read", (fn, default))

    def write(self, fn, reserve: int = 0):
        """`Shard.write` in the host (a failed write is not retried: it may have committed)."""
        if self._readonly:
            raise CatalogError(f"{self.path}: catalog is open read-only")
        self.generation()
        return self._call("write", (fn, reserve), self.writer)

    def stats(self) -> dict:
        self.generation()
        return self._call("stats")

    def sync(self) -> None:
        if self.fault is None and not self._readonly:
            self._call("sync", None, self.writer)

    def close(self) -> None:
        self.watch.close()

    def _call(self, op: str, payload=None, host: ShardHost | None = None):
        return self.settle(op, payload, (host or self.host).call_many([(op, self.index, payload)])[0])

    def settle(self, op: str, payload, reply: tuple[str, object]):
        """The value of the host's answer to this shard's request `(op, payload)`, or its error
        raised: ShardUnavailable, the shard quarantined, when the host died with the request in
        flight or LMDB found the shard's pages damaged."""
        kind, value = reply
        if kind == "ok":
            return value
        if kind == "lost":
            what = "a write (committed whole or not at all)" if op == "write" else f"a {op}"
            reason = f"its shard host {value} during {what}"
        elif kind == "err" and getattr(value, "damaged", False):
            reason = str(value).partition(" is unavailable: ")[2] or str(value)
        else:
            return unwrap(reply)
        catalog = self._catalog()
        if catalog is not None:
            catalog.quarantine(self, reason, (op, payload) if op in REPLAYED else None)
        raise self.unavailable(f"{reason}; quarantined until it reads again")


class IsolatedCatalog(Catalog):
    """A `Catalog` whose shards are mapped by shard hosts, never by this process (module doc).

    `hosts`: reading host processes (shard i -> host i % hosts; default min(4, CPUs, shards)),
    one more for writes (`writer`, started by the first), so a read never waits behind a write
    (LMDB readers never block on its writer either), and one for probes (`probe_host`, started
    by the first), so a probe that hangs or dies again holds up no reader;
    `timeout_s`: how long a host may take to answer one request before it is killed;
    `probe_backoff_s`: (first, longest) wait between probes of a quarantined shard.
    """

    def __init__(self, path: str | Path, readonly: bool = False, options: ShardOptions | None = None, *,
                 hosts: int | None = None, timeout_s: float = 60.0,
                 probe_backoff_s: tuple[float, float] = (0.5, 30.0)) -> None:
        super().__init__(path, readonly=readonly, options=options)
        opts = options or ShardOptions(readonly=readonly)
        count = max(1, min(hosts or min(4, os.cpu_count() or 1), self.shards))
        self.hosts = [ShardHost(self.path, opts, timeout_s) for _ in range(count)]
        self.writer = ShardHost(self.path, opts, timeout_s)  # started by the first write
        self.probe_host = ShardHost(self.path, opts, timeout_s)  # started by the first probe
        self._shards = [HostedShard(self, i, self.hosts[i % count], self.writer) for i in range(self.shards)]
        for shard in self._shards:  # every data file there now is its shard's: one removed or
            shard.check_file()      # replaced later is a fault, not an empty shard
        self.probe_backoff_s = probe_backoff_s
        # blobs read with their records by `resolve_ahead`, by (adapter id, revision): each is
        # taken once, by the request that resolved it (`take_carried`); the rest age out
        self.carried: BoundedLRU[tuple[str, str], tuple[str, bytes]] = BoundedLRU(CARRIED_BLOBS)
        self.carry_bytes = 0  # no blob is read ahead until a consumer asks (`carry_blobs`)
        self._qlock = threading.Lock()
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()
        self._finalizer = weakref.finalize(self, close_hosts, [*self.hosts, self.writer, self.probe_host])

    def host_pids(self) -> list[int]:
        """Process ids of the hosts running now (diagnostics, tests)."""
        return child_pids([*self.hosts, self.writer, self.probe_host])

    def _shards_blobs(self, by_shard: dict[int, list[RevisionRecord]]) -> dict[int, list | Exception | None]:
        """`Catalog._shards_blobs` through the hosts, all at once (`_on_hosts`): a page-in batch
        costs about one round trip, not one per shard."""
        return self._on_hosts("blobs", by_shard)

    def resolve_ahead(self, refs: list[tuple[str, str | None]]) -> None:
        """Read the revision records of many `(adapter_id, revision)` into the resolve cache in
        one exchange with the hosts (all at once, as a page-in batch), so that each request's
        own `resolve` is then a cache hit: the API process's cold resolves of one event-loop
        turn cost one round trip, not one each (bench/RESULTS.md, issue 29). Once a consumer
        asked for them (`carry_blobs`), a blob of at most `carry_bytes` is read in the same
        transaction as its record and kept in `carried` for the request to take to the engine
        (`take_carried`), whose page-in then reads nothing: a revision nobody has asked for
        lately is about to be paged in, and the host has its shard's transaction open already
        (bench/RESULTS.md, issue 41). Nothing is raised:
        an id that is invalid or unknown, or a shard that cannot answer, is left for that
        request's own `resolve` to report, as it would have without this (a host lost or a
        damaged page still quarantines the shard here, as `HostedShard.settle` does)."""
        todo: dict[ShardHost, list[tuple[tuple[str, str | None], HostedShard, tuple]]] = {}
        generations: dict[int, int | None] = {}
        for key in dict.fromkeys(refs):
            try:
                if key[1] is not None:
                    validate_revision(key[1])
                shard = self._shards[self.shard_index(validate_adapter_id(key[0]))]
                if shard.index not in generations:
                    generations[shard.index] = shard.generation()
            except CatalogError:  # ShardUnavailable too: the request's resolve answers it
                continue
            generation = generations[shard.index]
            if generation is not None and self.resolved.get(key, generation) is not None:
                continue
            lookup = functools.partial(lookup_carrying, adapter_id=key[0], revision=key[1],
                                       carry_bytes=self.carry_bytes)
            todo.setdefault(shard.host, []).append((key, shard, (lookup, None)))
        if not todo:
            return
        replies = call_hosts([(host, [("read", shard.index, payload) for _, shard, payload in items])
                              for host, items in todo.items()])
        for items, answers in zip(todo.values(), replies):
            for (key, shard, payload), reply in zip(items, answers):
                try:
                    found = shard.settle("read", payload, reply)
                except Exception:  # noqa: BLE001 - that request's own resolve reports it
                    continue
                if found is not None:
                    read_at, record, blob = found
                    self.resolved.put(key, read_at, record)
                    if blob is not None:
                        self.carried.put((record.adapter_id, record.revision), (record.checksum, blob))

    def carry_blobs(self, max_bytes: int = CARRY_BYTES) -> Callable[[RevisionRecord], bytes | None]:
        """From now on `resolve_ahead` reads each blob of at most `max_bytes` with its record;
        returns `take_carried`. For a consumer that hands blobs on with its requests (the
        engine client, where its transport takes an `Add`'s blob to the core); a resolver that
        does not (a Ray Serve ingress, whose replicas page adapters in themselves) leaves it off
        and reads records only."""
        self.carry_bytes = max_bytes
        return self.take_carried

    def take_carried(self, record: RevisionRecord) -> bytes | None:
        """The blob `resolve_ahead` read with `record`, once (verified against this very record:
        its checksum was checked in the record's own transaction); None when none was read."""
        held = self.carried.pop((record.adapter_id, record.revision))
        if held is None or held[0] != record.checksum or len(held[1]) != record.size:
            return None
        return held[1]

    def _read_every(self, bodies: dict[int, functools.partial], what: str) -> dict[int, list]:
        """`Catalog._read_every` (a listing's rounds) through the hosts, all at once."""
        found = self._on_hosts("read", {i: (body, []) for i, body in bodies.items()})
        down = [i for i, v in found.items() if isinstance(v, ShardUnavailable)]
        if down:
            raise self._needs_every(what, sorted(down))
        for value in found.values():
            if isinstance(value, Exception):
                raise value
        return found

    def _on_hosts(self, op: str, payloads: dict[int, object]) -> dict[int, object]:
        """`{shard: the value of request (op, payloads[shard]), or its exception}`. Each host
        gets its shards' requests in one exchange, every host before any answer is read
        (`shardhost.call_hosts`); a request a dead host never started goes to its replacement."""
        found: dict[int, object] = {}
        todo: dict[ShardHost, list[int]] = {}
        for index in payloads:
            try:
                self._shards[index].generation()  # quarantined or a faulty file: 503 at once
                todo.setdefault(self._shards[index].host, []).append(index)
            except ShardUnavailable as e:
                found[index] = e
        while todo:
            batches = [(host, [(op, i, payloads[i]) for i in indices]) for host, indices in todo.items()]
            replies, sent, todo = call_hosts(batches), list(todo.values()), {}
            for (host, _), indices, answers in zip(batches, sent, replies):
                for index, reply in zip(indices, answers):
                    if reply[0] == "unsent":  # its host died before it: to the replacement
                        todo.setdefault(host, []).append(index)
                        continue
                    try:
                        found[index] = self._shards[index].settle(op, payloads[index], reply)
                    except Exception as e:  # noqa: BLE001 - the shard's own answer
                        found[index] = e
        return found

    # -- quarantine --------------------------------------------------------------------------------
    def quarantine(self, shard: HostedShard, reason: str, replay: tuple | None) -> None:
        """Put `shard` in quarantine (no-op if it is already) and make sure the prober runs."""
        with self._qlock:
            if shard.quarantine is None:
                first = self.probe_backoff_s[0]
                shard.quarantine = Quarantine(reason, replay, first, time.monotonic() + first,
                                              shard.watch.signature())
                log.warning("catalog shard %d (%s) quarantined: %s", shard.index, shard.path, reason)
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(target=self._probe_loop, name="loraserve-catalog-prober",
                                                daemon=True)
                self._prober.start()

    def _probe_loop(self) -> None:
        """Probe quarantined shards when due (see module doc); ends when none is left."""
        while not self._closed.is_set():
            with self._qlock:
                held = [s for s in self._shards if s.quarantine is not None]
                if not held:
                    self._prober = None
                    return
            now = time.monotonic()
            for shard in held:
                q = shard.quarantine
                if q is not None and (now >= q.due or shard.watch.signature() != q.signature):
                    self.probe(shard, q)
            self._closed.wait(PROBE_POLL_S)

    def probe(self, shard: HostedShard, q: Quarantine) -> None:
        """Probe `shard` now (the prober, or a request that finds its file changed); one probe
        of a shard at a time, and none of a quarantine another probe has settled meanwhile."""
        with shard.probing:
            if shard.quarantine is q:
                self._probe(shard, q)

    def _probe(self, shard: HostedShard, q: Quarantine) -> None:
        signature = shard.watch.signature()  # before the probe: a change during it is seen next time
        try:
            shard.check_file()
            if shard.file_fault is not None:  # the file itself is at fault (truncated, replaced):
                raise CatalogError(shard.file_fault)  # nothing to probe until it changes
            self.probe_host.call("probe", shard.index, q.replay)
        except (HostLost, CatalogError) as e:
            q.backoff = min(2 * q.backoff, self.probe_backoff_s[1])
            q.due, q.signature = time.monotonic() + q.backoff, signature
            log.info("catalog shard %d still quarantined (next probe in %.1f s): %s", shard.index, q.backoff, e)
            return
        with self._qlock:
            shard.quarantine = None
        log.warning("catalog shard %d (%s) reads again: quarantine lifted", shard.index, shard.path)

    # -- lifecycle ---------------------------------------------------------------------------------
    def sync(self) -> None:
        for s in self._shards:
            try:
                s.sync()
            except ShardUnavailable as e:  # a shard that cannot sync now is reported, the others go on
                log.warning("catalog sync: %s", e)

    def close(self) -> None:
        """Stop the prober, end and reap every host, close the data file watches."""
        self._closed.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(10)
        self._finalizer()
        for s in self._shards:
            s.close()
        self.resolved.clear()
