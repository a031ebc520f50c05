"""Adapter endpoints: residency, catalog listing, vLLM-compatible runtime load/unload, readiness.

Mounted by `build_app` when the engine serves a catalog (`engine.catalog` is not None).

A `lora_path` that is a URI (`s3://`, `hf://`, `file://`) is fetched from the `--adapter-source`
template it is `lora_name`'s location in, and refused (403) when it is in none (fetch_adapter).
Runtime imports (`POST /v1/load_lora_adapter`) are confined and bounded: files are read only
inside `--adapter-root`, never through a link leaving it, only regular files, at most
`--max-adapter-mb` in all (catalog.source); the adapter is checked against this server's pool
(rank, targets) before anything is written; and imports run on their own small thread pool
with a deadline (`ImportRunner`, one per app), so a slow or hostile import never holds a thread
that page-ins or other requests need.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, field_validator

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.errors import CatalogError, InvalidAdapterId
from loraserve.catalog.importer import import_peft
from loraserve.catalog.ids import validate_adapter_id, with_default_tenant
from loraserve.catalog.records import RevisionRecord
from loraserve.catalog.source import AdapterSource
from loraserve.engine.interface import CatalogView
from loraserve.engine.types import EngineError
from loraserve.server.admin_routes import control_action
from loraserve.server.errors import APIError, as_api_error
from loraserve.server.names import lookup_error
from loraserve.server.tenancy import check_visible_id, principal_of

T = TypeVar("T")
MiB = 1 << 20
IMPORT_WORKERS = 2
IMPORT_DEADLINE_S = 60.0
IMPORT_MAX_PENDING = 16  # queued + running; more is a 503, not an ever longer queue


async def _off_loop(fn, *args, **kw):
    """Run a blocking catalog/pager call on a thread; its errors become OpenAI error bodies."""
    try:
        return await asyncio.to_thread(fn, *args, **kw)
    except (CatalogError, EngineError) as exc:
        raise as_api_error(exc) from exc


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str

    @field_validator("lora_name")
    @classmethod
    def _tenant(cls, name: str) -> str:
        """vLLM's names have no tenant: `sql-lora` is the default tenant's `default/sql-lora`
        (the key's tenant checks and the audit line see that id)."""
        return with_default_tenant(name)


class LoadLoRARequest(UnloadLoRARequest):
    lora_path: str


def _engine(request: Request):
    """The engine, when it serves a catalog."""
    engine = request.app.state.ctx.engine
    if engine.catalog is None:
        raise APIError(404, "this server has no adapter catalog (start it with --catalog)", code="not_found")
    return engine


def catalog_cards(view: CatalogView, prefix: str, limit: int, after: str | None,
                  root: str) -> list[dict]:
    return [{"id": p.adapter_id, "object": "model", "created": int(p.created), "owned_by": "loraserve",
             "root": root, "parent": root, "revision": p.promoted}
            for p in view.catalog.list(prefix=prefix, limit=limit, after=after)]


def readiness(engine) -> APIError | None:
    """None when the server can serve every adapter it holds; else the 503 to answer `/ready` with
    (a catalog shard is unavailable). Cheap: remembered shard checks, no LMDB page is read."""
    view = engine.catalog
    if view is None:
        return None
    faults = view.catalog.degraded()
    if not faults:
        return None
    shards = sorted(faults)
    return APIError(503, f"catalog shards unavailable: {', '.join(map(str, shards))} "
                         f"(shard {shards[0]}: {faults[shards[0]]})", code="catalog_unavailable")


class ImportRunner:
    """Adapter imports on their own `workers` threads, at most `max_pending` queued or running,
    each answered within `deadline_s` (504 past it; an import still running then is not
    written once its checks find the deadline passed)."""

    def __init__(self, workers: int = IMPORT_WORKERS, deadline_s: float = IMPORT_DEADLINE_S,
                 max_pending: int = IMPORT_MAX_PENDING) -> None:
        if workers < 1 or deadline_s <= 0 or max_pending < workers:
            raise ValueError("need workers >= 1, deadline_s > 0, max_pending >= workers")
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loraserve-import")
        self._lock = threading.Lock()
        self._pending = 0

    async def run(self, job: Callable[[float], T]) -> T:
        """`job(deadline)` on the pool (deadline: a time.monotonic() value); its result."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise APIError(503, f"{self._pending} adapter imports in progress; retry later", code="overloaded")
            self._pending += 1
        deadline = time.monotonic() + self.deadline_s
        fut = self._pool.submit(job, deadline)
        fut.add_done_callback(self._finished)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.deadline_s)
        except asyncio.TimeoutError:
            raise APIError(504, f"adapter import did not finish within {self.deadline_s:g} s",
                           code="import_timeout") from None

    def _finished(self, _fut) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _runner(request: Request) -> ImportRunner:
    """The app's ImportRunner (`app.state.adapter_imports`), made on first use."""
    state = request.app.state
    runner = getattr(state, "adapter_imports", None)
    if runner is None:
        runner = state.adapter_imports = ImportRunner()
    return runner


def import_adapter(engine, name: str, lora_path: str, deadline: float) -> RevisionRecord:
    """Blocking: read `lora_path` confined to the adapter root, export it, admit it against this
    server's pool and the deadline, then write, promote and page it in. Raises before the write
    on any refusal, so a refused import leaves the catalog unchanged."""
    view, cfg = engine.catalog, engine.config
    validate_adapter_id(name)
    source = AdapterSource(lora_path, root=cfg.adapter_root, max_bytes=cfg.max_adapter_mb * MiB)
    if engine.sourcing is not None:
        engine.sourcing.store_first(name)  # numbered after the durable tier's revisions

    def admit(rank: int, targets: list[str]) -> None:
        try:
            view.pool.check_admissible(rank, targets)
        except ValueError as exc:
            raise APIError(400, f"adapter {name!r} cannot be served here: {exc}; nothing was imported",
                           param="lora_path") from None
        if time.monotonic() > deadline:
            raise APIError(504, "adapter import ran past its deadline; nothing was imported", code="import_timeout")

    base = BaseInfo.from_dir(cfg.model_dir, fingerprint=view.base_fingerprint)  # headers only
    rec = import_peft(view.catalog, name, source, cfg.model_dir, promote=True, base=base, admit=admit)
    view.warm(f"{rec.adapter_id}@{rec.revision}")
    return rec


def fetch_adapter(engine, name: str, uri: str, deadline: float) -> RevisionRecord:
    """Blocking: `uri` fetched from the adapter source it is `name`'s location in (403 when it
    is none: the key's tenants were checked against `name`, so a URI only fetches inside them),
    verified, exported, admitted against this server's pool, imported, promoted and paged in."""
    validate_adapter_id(name)
    if engine.sourcing is None:
        raise APIError(403, f"{uri!r} is not a path under --adapter-root, and no --adapter-source is configured",
                       param="lora_path", code="forbidden")
    rec = engine.sourcing.load(name, uri)
    engine.catalog.warm(f"{rec.adapter_id}@{rec.revision}")
    return rec


def _import_error(exc: CatalogError | EngineError) -> APIError:
    """The API error of a failed import, its `param` the request field at fault."""
    err = as_api_error(exc)
    if isinstance(exc, InvalidAdapterId):
        err.param = "lora_name"
    elif err.status < 500 and err.status != 409:
        err.param = "lora_path"
    return err


def adapter_router() -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/adapters/{adapter_id:path}")
    async def adapter(adapter_id: str, request: Request) -> dict:
        check_visible_id(principal_of(request), adapter_id)  # another tenant's: as if absent
        try:
            return await _off_loop(_engine(request).describe_adapter, adapter_id)
        except APIError as err:
            raise lookup_error(err, adapter_id) from err

    @router.post("/load_lora_adapter")
    @control_action("load", adapter=lambda kw: kw["body"].lora_name)  # keys, tenants, audit
    async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> dict:
        engine = _engine(request)
        remote = "://" in body.lora_path  # a URI of an --adapter-source; else a dir under --adapter-root
        if not remote and not engine.config.adapter_root:
            raise APIError(403, "runtime adapter loading is disabled: start the server with --adapter-root DIR",
                           param="lora_path", code="forbidden")
        load = fetch_adapter if remote else import_adapter
        try:
            rec = await _runner(request).run(
                lambda deadline: load(engine, body.lora_name, body.lora_path, deadline))
        except (CatalogError, EngineError) as exc:
            raise _import_error(exc) from exc
        return {"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                "id": rec.adapter_id, "revision": rec.revision}

    @router.post("/unload_lora_adapter")
    @control_action("unload", adapter=lambda kw: kw["body"].lora_name)
    async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> dict:
        try:
            evicted = await _engine(request).unload_adapter(body.lora_name)
        except (CatalogError, EngineError) as exc:
            raise lookup_error(as_api_error(exc), body.lora_name) from exc
        return {"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                "evicted": evicted}

    return router
