"""Adapters the catalog lacks, fetched on a miss: the durable tier, then the adapter sources.

A request whose model names `tenant/name[@rev]` that this process's catalog does not hold
(the directory's 404) comes here, off the event loop, on this object's own threads (so a slow
store never takes a thread that other requests' resolves or page-ins need):

1. the name is decided as the directory decides it (an alias resolved), and the principal must
   see its tenant, else nothing is fetched and the answer stays the one 404 (a template then
   only ever yields ids inside the requesting key's tenants);
2. `--catalog-store`: the revision is faulted in from the durable tier (catalog.store_s3); with
   the store down, a bare `tenant/name` goes on to the sources (imported under a revision id
   named after its bytes; once the store answers again it is published, or, when the store
   holds the adapter with other bytes, replaced by the store's: StoreTier.provisional), and the
   store's 503 stands only when no source has it;
3. `--adapter-source` (a bare `tenant/name` only: a source holds one version of an adapter):
   the PEFT directory is fetched (catalog.sources, verified by catalog.fetchers), exported
   against the served base, checked against the pool's limits and imported as a new promoted
   revision, its record's source the URI;

(each source behind its own bulkhead: threads, a cap, an overall deadline per fetch; any
failure of a source is a 503 with Retry-After naming it, and the next source is tried);
then the directory resolves the name again and the request goes on as any request for a cold
adapter: its revision is paged in while it waits parked. Concurrent misses for one id fetch it
once (single flight: AdapterSources for the sources, `fault_ins` for the tier). A store that
is down is a 503 (retry later); a bad adapter a 400 naming why; no source holding it the
usual 404. Past `deadline_s` a request stops waiting with a 503 (the fetch finishes and is
kept for the next request).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

from loraserve.catalog.aliases import is_alias
from loraserve.catalog.base import BaseInfo
from loraserve.catalog.errors import (AdapterNotFound, CatalogError, InvalidAdapterId, RevisionNotFound,
                                      SourceNotFound, SourceUnavailable)
from loraserve.catalog.ids import parse_model_ref
from loraserve.catalog.records import RevisionRecord
from loraserve.catalog.sources import AdapterSources, SingleFlight, importer

from ..config import EngineConfig
from ..directory import AdapterDirectory, Viewer
from ..interface import CatalogView
from ..types import EngineError, ResolvedModel

log = logging.getLogger(__name__)
MiB = 1 << 20
# misses being resolved at once: each mostly waits on a source's bulkhead (catalog.sources:
# its own threads, cap and deadline), so a slow source never holds all of these
FETCH_WORKERS = 16
FETCH_MAX_PENDING = 64  # queued + running; more is a 503, not an ever longer queue
FETCH_DEADLINE_S = 120.0


class Sourcing:
    """The miss path of one API process (module doc). `view`: the engine frontend's
    `CatalogView`, whose catalog the fetched revisions go into (`catalog`, `pool`)."""

    def __init__(self, cfg: EngineConfig, view: CatalogView, directory: AdapterDirectory, *,
                 deadline_s: float = FETCH_DEADLINE_S) -> None:
        self.cfg, self.view, self.directory = cfg, view, directory
        self.deadline_s = deadline_s
        self.sources = (AdapterSources(cfg.adapter_sources, max_bytes=cfg.max_adapter_mb * MiB,
                                       deadline_s=cfg.source_deadline_s)
                        if cfg.adapter_sources else None)
        self.tier = None
        if cfg.catalog_store:
            from loraserve.catalog.store_s3 import ObjectStore, StoreTier, parse_store_uri
            uri, cache_mb = parse_store_uri(cfg.catalog_store)
            self.tier = StoreTier(ObjectStore(uri), view.catalog,
                                  max_bytes=None if cache_mb is None else cache_mb << 20)
            self.tier.start()
        self.fault_ins = SingleFlight()  # fault-ins from the tier (the sources have their own)
        self._pool = ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="loraserve-fetch")
        self._lock = threading.Lock()
        self._pending = 0

    @classmethod
    def open(cls, cfg: EngineConfig, view: CatalogView | None,
             directory: AdapterDirectory) -> Sourcing | None:
        """The process's Sourcing, or None when nothing is configured; a source or store without a
        catalog to import into is refused at start-up."""
        if not cfg.adapter_sources and not cfg.catalog_store:
            return None
        if view is None:
            raise ValueError("--adapter-source and --catalog-store need a catalog (--catalog DIR) to import into")
        return cls(cfg, view, directory)

    async def fetch_missing(self, model: str, principal: Viewer) -> bool:
        """Whether `model`, which the directory did not find, is now in the catalog (module doc)."""
        with self._lock:
            if self._pending >= FETCH_MAX_PENDING:
                raise EngineError(f"{self._pending} adapter fetches in progress; retry later",
                                  status=503, code="overloaded")
            self._pending += 1
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._fetch, model, principal)
            return await asyncio.wait_for(asyncio.shield(fut), self.deadline_s)
        except asyncio.TimeoutError:
            err = EngineError(f"adapter {model!r} is still being fetched after {self.deadline_s:g} s; "
                              "retry later", status=503, code="source_unavailable")
            err.retry_after = 5
            raise err from None
        finally:
            with self._lock:
                self._pending -= 1

    def _fetch(self, model: str, principal: Viewer) -> bool:
        """Blocking, on a fetch thread: fault in from the tier, else fetch from the sources."""
        try:
            adapter_id, revision = parse_model_ref(self.directory.canonical(model))
        except InvalidAdapterId:
            return False
        if not principal.sees(adapter_id.split("/", 1)[0]):
            return False
        try:
            if self.tier is not None and self._from_store(adapter_id, revision, settled=True):
                return True
            if self.sources is None or revision is not None:
                return False
            self.sources.fetch(adapter_id, self.into(adapter_id))
            return True
        except SourceNotFound:
            return False
        except CatalogError as exc:
            if exc.status >= 500:
                raise
            raise EngineError(f"adapter {adapter_id!r} cannot be served: {exc}", status=exc.status,
                              param="model") from exc

    def _from_store(self, adapter_id: str, revision: str | None, settled: bool = False) -> bool:
        """Fault in from the tier; with the store down, a bare id comes from the sources instead,
        imported provisionally (not published until the store answers: StoreTier.provisional);
        no source holding it leaves the store's 503. `settled`: nothing is faulted in when the
        catalog here holds the ref by then (`_fault_in`)."""
        try:
            return self._fault_in(adapter_id, revision, settled)
        except SourceUnavailable as down:
            if self.sources is None or revision is not None:
                raise
            log.warning("catalog store down (%s); fetching %s from the adapter sources", down, adapter_id)
            try:
                self.tier.provisional(adapter_id, lambda: self.sources.fetch(
                    adapter_id, self.into(adapter_id, by_content=True)))
            except SourceNotFound:
                raise down from None
            return True

    def _fault_in(self, adapter_id: str, revision: str | None, settled: bool = False) -> bool:
        """From the durable tier, once for concurrent misses of one revision. `settled`: a miss
        (the request's ref was not here) that finds the ref here by the time it would start a
        fault-in, because a concurrent miss's fault-in just landed, starts none."""
        def here() -> bool:
            try:
                self.view.catalog.resolve(adapter_id, revision)
            except CatalogError:
                return False
            return True

        try:
            self.fault_ins.run(f"{adapter_id}@{revision}", lambda: self.tier.fault_in(adapter_id, revision),
                               here if settled else None)
        except (AdapterNotFound, RevisionNotFound):
            return False
        return True

    def into(self, adapter_id: str, by_content: bool = False):
        """How a fetched directory becomes a revision here: exported against the served base,
        admitted against the pool's limits (400 otherwise), imported and promoted (`by_content`:
        under an id named after its bytes, catalog.sources.content_revision)."""
        base = BaseInfo.from_dir(self.cfg.model_dir, fingerprint=self.view.base_fingerprint)

        def admit(rank: int, targets: list[str]) -> None:
            try:
                self.view.pool.check_admissible(rank, targets)
            except ValueError as exc:
                raise EngineError(f"adapter {adapter_id!r} cannot be served here: {exc}; nothing was "
                                  "imported", status=400, param="model") from None
        return importer(self.view.catalog, adapter_id, self.cfg.model_dir, base, admit, by_content=by_content)

    def touch(self, adapter_id: str) -> None:
        """Event loop: a request resolved `adapter_id` (the durable tier's recency)."""
        if self.tier is not None:
            self.tier.touch(adapter_id)

    def load(self, adapter_id: str, uri: str) -> RevisionRecord:
        """Blocking: `/v1/load_lora_adapter` with a source URI: fetched from the one template it
        is `adapter_id`'s location in (403 otherwise), imported and promoted. The caller named
        these bytes, so they win over the store's: with `--catalog-store` the store's revisions
        are faulted in first, so the import is numbered after them (and is the promoted one
        when its bytes are), then published (the store down: 503, nothing imported)."""
        if self.sources is None:
            raise EngineError("no adapter sources are configured (start the server with --adapter-source)",
                              status=403, code="forbidden", param="lora_path")
        only = self.sources.template_of(uri, adapter_id)
        self.store_first(adapter_id)
        return self.sources.fetch(adapter_id, self.into(adapter_id), only=only)

    def store_first(self, adapter_id: str) -> None:
        """Blocking, before a load writes a revision of `adapter_id`: with `--catalog-store`,
        the store's revisions of it are faulted in first, so the new one is numbered after them
        (an `r1` of other bytes than the store's `r1` would never be published). The store
        down: its 503, before anything is written."""
        if self.tier is not None:
            self._fault_in(adapter_id, None)

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        if self.sources is not None:
            self.sources.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class ResolveAhead:
    """The cold resolves of one event-loop turn, read from the catalog in one exchange.

    With the catalog behind shard hosts (`IsolatedCatalog`), each cold resolve was a blocking
    round trip to a host process on the event loop: at namespace scale, where most requests
    name a revision never seen, that was the API process's largest cost of a cold request
    (bench/RESULTS.md, issue 29). A request for a ref that is not warm now registers it here
    and waits for the end of the turn; the turn's refs are read together
    (`IsolatedCatalog.resolve_ahead`: one exchange with the hosts, all at once), which fills
    the catalog's resolve cache, and each request then resolves as before, from that cache,
    with every check made as before (visibility, base, limits, the shard's health). The read
    runs on the event loop while `warm` keeps cold reads inline, else on a worker thread."""

    def __init__(self, catalog) -> None:
        self.catalog = catalog
        self._batch: dict[tuple[str, str | None], None] | None = None
        self._done: asyncio.Future | None = None

    @staticmethod
    def of(catalog) -> ResolveAhead | None:
        """The catalog's coalescer; None when its resolves are in-process reads (nothing to
        coalesce)."""
        if not hasattr(catalog, "resolve_ahead"):
            return None
        ahead = _AHEAD.get(catalog)
        if ahead is None:
            ahead = _AHEAD[catalog] = ResolveAhead(catalog)
        return ahead

    async def prefetch(self, directory: AdapterDirectory, model: str, warm) -> None:
        """Wait for the end of this turn, by when `model`'s revision record has been read
        together with the turn's other cold refs (nothing is raised here: the request's own
        resolve reports whatever is wrong with the name)."""
        if is_alias(model) or model == directory.base_name:
            return
        try:
            key = parse_model_ref(directory.canonical(model))
        except InvalidAdapterId:
            return
        if self._batch is None:
            loop = asyncio.get_running_loop()
            self._batch, self._done = {}, loop.create_future()
            loop.call_soon(self._flush, warm)
        self._batch[key] = None
        await asyncio.shield(self._done)
        warm.touch(model)  # its record is in the catalog's resolve cache: resolved inline next

    def _flush(self, warm) -> None:
        """Event loop, at the end of the turn: read the batch, then let its requests go on."""
        batch, done = list(self._batch), self._done
        self._batch = self._done = None
        if warm.cold_inline():
            started = time.perf_counter()
            self._read(batch)
            warm.timed((time.perf_counter() - started) / len(batch))  # a read's share of it
            done.set_result(None)
            return
        task = asyncio.get_running_loop().run_in_executor(None, self._read, batch)
        task.add_done_callback(lambda _: done.set_result(None))

    def _read(self, batch: list[tuple[str, str | None]]) -> None:
        try:
            self.catalog.resolve_ahead(batch)
        except Exception:  # noqa: BLE001 - each request's own resolve meets it again
            log.debug("resolving %d refs ahead failed", len(batch), exc_info=True)


_AHEAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # catalog -> its ResolveAhead


async def resolve(warm, directory: AdapterDirectory, sourcing: Sourcing | None, model: str,
                  principal: Viewer) -> ResolvedModel:
    """`directory.resolve(model, principal)` through `warm` (`WarmRefs`: on the event loop while
    recent reads were fast, a catalog read costing less than the thread hop around it, else on a
    worker thread); a ref that is not warm is read first with the turn's other cold refs, in one
    exchange (`ResolveAhead`). A name the catalog lacks is fetched by `sourcing` (the durable
    tier, the adapter sources) off the event loop and resolved again; still missing, the one
    404. The miss path of both hostings: the single server's frontend and the Ray ingress."""
    if not warm.is_warm(model) and (ahead := ResolveAhead.of(getattr(directory, "catalog", None))) is not None:
        await ahead.prefetch(directory, model, warm)
    try:
        resolved = await warm.call(model, directory.resolve, model, principal)
    except (EngineError, CatalogError) as exc:  # CatalogError: RevisionNotFound
        if exc.status != 404 or sourcing is None:
            raise
        if not await sourcing.fetch_missing(model, principal):
            raise
        resolved = await warm.call(model, directory.resolve, model, principal)
    if sourcing is not None and resolved.adapter is not None:
        sourcing.touch(resolved.adapter[0])  # the local cache's recency (--catalog-store)
    return resolved
