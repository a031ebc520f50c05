"""Tenancy wired into the app: the control-plane guard, the admin and control routes, SIGHUP.

- `control_action` guards and audits every handler that changes adapters (load, unload,
  promote, rollback): an admin key may do anything, a user key with `load` only inside its own
  tenants, any other key nothing.
- `POST /v1/adapters/{id}/promote {"revision"}` and `POST /v1/adapters/{id}/rollback` move the
  catalog's promoted pointer (requests already running keep their revision).
- `POST /admin/reload-keys` (admin) and SIGHUP re-read the keys file without dropping requests.
- `install_tenancy` puts all of it (and the AuthMiddleware) on an app.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from loraserve.catalog.errors import CatalogError
from loraserve.keys import KeyFileError, Principal
from loraserve.server.audit_log import DENIED, FAILED, OK
from loraserve.server.errors import APIError, as_api_error
from loraserve.server.names import lookup_error
from loraserve.server.tenancy import (AuthMiddleware, Tenancy, TenancyConfig, forbidden, hidden,
                                      principal_of, split_id)

log = logging.getLogger("loraserve.server")

Kwargs = dict[str, Any]


def control_action(action: str, adapter: Callable[[Kwargs], str],
                   revision: Callable[[Kwargs], str | None] = lambda kw: None):
    """Guard and audit a FastAPI handler (it takes `request`) of a control-plane `action` on the
    adapter `adapter(kwargs)` names; `revision(kwargs)` is the revision asked for, if any.

    Before it runs (`authorize_control`): 403 for a key that may not change adapters, 403 for
    loading into a tenant the key may not see, and for any other action there the 404 of an id
    that does not exist (names.not_found); the same answers whether or not the id exists. Every
    outcome is one audit line; the revision of a success is its answer's "revision", when it
    has one.
    """
    def wrap(handler):
        @functools.wraps(handler)
        async def run(*args: Any, **kwargs: Any) -> Any:
            request: Request = kwargs["request"]
            principal, adapter_id = principal_of(request), adapter(kwargs)
            line = dict(key=principal.key_id, action=action, adapter=adapter_id,
                        revision=revision(kwargs))
            audit = request.app.state.tenancy.audit
            try:
                authorize_control(principal, action, adapter_id)
            except APIError as denied:
                audit.record(**line, outcome=DENIED, status=denied.status, error=denied.message)
                raise
            try:
                result = await handler(*args, **kwargs)
            except Exception as exc:
                error = as_api_error(exc)
                audit.record(**line, outcome=FAILED, status=error.status, error=error.message)
                raise error from exc
            if isinstance(result, dict) and result.get("revision"):
                line["revision"] = result["revision"]
            audit.record(**line, outcome=OK)
            return result

        return run

    return wrap


def authorize_control(principal: Principal, action: str, adapter_id: str) -> None:
    """Raise unless `principal` may do `action` on `adapter_id` (see control_action); an
    invalid id (one with `@rev` too: these routes take plain ids) is left to the handler (a
    400), whichever tenant it names."""
    if principal.admin:
        return
    if not principal.load:
        raise forbidden("this key may not load, unload, promote or roll back adapters")
    ref = split_id(adapter_id)
    if ref is None or principal.may_control(ref[1]):
        return
    if action == "load":
        raise forbidden(f"this key may not load `{adapter_id}`: its tenant is not one of the "
                        "key's")
    raise hidden(adapter_id)


# -- routes --------------------------------------------------------------------------------------

class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    revision: str


def _policy_answer(policy: Any) -> dict:
    return {"status": "ok", "id": policy.adapter_id, "revision": policy.promoted,
            "promoted": policy.promoted, "previous": policy.previous}


async def _catalog_call(request: Request, name: str, adapter_id: str, *args: Any) -> Any:
    """Run catalog method `name` on `adapter_id` on a thread; catalog errors become their OpenAI
    errors (an unknown id: names.not_found)."""
    catalog = request.app.state.ctx.engine.catalog.catalog
    try:
        return await asyncio.to_thread(getattr(catalog, name), adapter_id, *args)
    except CatalogError as exc:
        raise lookup_error(as_api_error(exc), adapter_id) from exc


def control_router() -> APIRouter:
    """Promote and rollback (mounted when the engine serves a catalog)."""
    router = APIRouter(prefix="/v1")

    @router.post("/adapters/{adapter_id:path}/promote")
    @control_action("promote", adapter=lambda kw: kw["adapter_id"],
                    revision=lambda kw: kw["body"].revision)
    async def promote(adapter_id: str, body: PromoteRequest, request: Request) -> dict:
        """Serve `revision` (a revision id or tag) of the adapter from now on."""
        return _policy_answer(await _catalog_call(request, "promote", adapter_id, body.revision))

    @router.post("/adapters/{adapter_id:path}/rollback")
    @control_action("rollback", adapter=lambda kw: kw["adapter_id"])
    async def rollback(adapter_id: str, request: Request) -> dict:
        """Serve the previously promoted revision again (404 when there is none)."""
        return _policy_answer(await _catalog_call(request, "rollback", adapter_id))

    return router


def admin_router() -> APIRouter:
    router = APIRouter(prefix="/admin")

    @router.post("/reload-keys")
    async def reload_keys(request: Request) -> dict:
        """Re-read the keys file (admin key only); 400 with the reason keeps the old keys."""
        principal = principal_of(request)
        if not principal.admin:  # AuthMiddleware refused it already; kept for routes' sake
            raise forbidden("this route needs an admin key")
        try:
            store = request.app.state.tenancy.reload_keys(principal.key_id)
        except KeyFileError as exc:
            raise APIError(400, str(exc), code="invalid_keys_file") from exc
        return {"status": "ok", "keys": len(store)}

    return router


# -- wiring --------------------------------------------------------------------------------------

def install_tenancy(app: FastAPI, config: TenancyConfig) -> Tenancy:
    """Put tenancy on `app` (built by build_app: `app.state.ctx` set): `app.state.tenancy`, the
    AuthMiddleware (added now: inside middleware added later), the admin and control routes,
    and SIGHUP reloading the keys while the app runs. KeyFileError for a bad keys file."""
    ctx = app.state.ctx
    tenancy = Tenancy(config, ctx.metrics)
    app.state.tenancy = tenancy
    app.include_router(admin_router())
    if ctx.engine.catalog is not None:
        app.include_router(control_router())
    app.add_middleware(AuthMiddleware, tenancy=tenancy)
    app.router.lifespan_context = _with_sighup(app.router.lifespan_context, tenancy)
    return tenancy


def _with_sighup(lifespan: Callable[[Any], Any], tenancy: Tenancy) -> Callable[[Any], Any]:
    @contextlib.asynccontextmanager
    async def lifespan_with_sighup(app: Any) -> AsyncIterator[Any]:
        async with lifespan(app) as state:
            with reload_on_sighup(tenancy):
                yield state

    return lifespan_with_sighup


@contextlib.contextmanager
def reload_on_sighup(tenancy: Tenancy) -> Iterator[None]:
    """While the block runs, SIGHUP re-reads the keys file on the running loop. Only a loop in
    the main thread can take signals (uvicorn.run's); elsewhere (a test's server thread) this
    does nothing, as without a keys file."""
    loop = asyncio.get_running_loop()
    installed = False
    if tenancy.config.keys_file is not None and hasattr(signal, "SIGHUP"):
        try:
            loop.add_signal_handler(signal.SIGHUP, on_sighup, tenancy)
            installed = True
        except (RuntimeError, ValueError):  # not the main thread
            pass
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGHUP)


def on_sighup(tenancy: Tenancy) -> None:
    """Reload the keys; a bad file is logged and the old keys stay."""
    try:
        store = tenancy.reload_keys(None)
    except KeyFileError as exc:
        log.error("SIGHUP: keys not reloaded, the old ones stay: %s", exc)
    else:
        log.info("SIGHUP: %d keys loaded from %s", len(store), tenancy.config.keys_file)
