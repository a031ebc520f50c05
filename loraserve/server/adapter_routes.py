"""Adapter endpoints: residency, catalog listing, vLLM-compatible runtime load/unload.

Mounted by `build_app` when the engine serves a catalog (`engine.adapter_manager` is not None).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from loraserve.catalog.errors import CatalogError
from loraserve.catalog.importer import import_peft
from loraserve.engine.types import EngineError
from loraserve.server.admin_routes import control_action
from loraserve.server.errors import APIError, as_api_error
from loraserve.server.tenancy import check_visible, principal_of


async def _off_loop(fn, *args, **kw):
    """Run a blocking catalog/pager call on a thread; its errors become OpenAI error bodies."""
    try:
        return await asyncio.to_thread(fn, *args, **kw)
    except (CatalogError, EngineError) as exc:
        raise as_api_error(exc) from exc


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str


def _engine(request: Request):
    """The engine, when it serves a catalog."""
    engine = request.app.state.ctx.engine
    if engine.adapter_manager is None:
        raise APIError(404, "this server has no adapter catalog (start it with --catalog)", code="not_found")
    return engine


def check_under_root(path: str, root: str | None) -> Path:
    """The PEFT dir `path` if it is inside `root`: 403 outside (or no root), 404 missing."""
    if not root:
        raise APIError(403, "runtime adapter loading is disabled: start the server with --adapter-root DIR",
                       param="lora_path", code="forbidden")
    base = Path(root).resolve()
    target = (base / path).resolve() if not Path(path).is_absolute() else Path(path).resolve()
    if not target.is_relative_to(base):
        raise APIError(403, f"lora_path {path!r} is outside the allowed adapter root", param="lora_path",
                       code="forbidden")
    if not target.exists():
        raise APIError(404, f"lora_path {path!r} does not exist", param="lora_path", code="not_found")
    return target


def catalog_cards(mgr, prefix: str, limit: int, after: str | None, root: str) -> list[dict]:
    return [{"id": p.adapter_id, "object": "model", "created": int(p.created), "owned_by": "loraserve",
             "root": root, "parent": root, "revision": p.promoted}
            for p in mgr.catalog.list(prefix=prefix, limit=limit, after=after)]


def adapter_router() -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/adapters/{adapter_id:path}")
    async def adapter(adapter_id: str, request: Request) -> dict:
        check_visible(principal_of(request), adapter_id)  # another tenant's: as if absent
        return await _off_loop(_engine(request).describe_adapter, adapter_id)

    @router.post("/load_lora_adapter")
    @control_action("load", adapter=lambda kw: kw["body"].lora_name)  # keys, tenants, audit
    async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> dict:
        engine = _engine(request)
        mgr, cfg = engine.adapter_manager, engine.config
        peft_dir = check_under_root(body.lora_path, cfg.adapter_root)
        rec = await _off_loop(import_peft, mgr.catalog, body.lora_name, peft_dir, cfg.model_dir, promote=True)
        await _off_loop(mgr.warm, f"{rec.adapter_id}@{rec.revision}")
        return {"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                "id": rec.adapter_id, "revision": rec.revision}

    @router.post("/unload_lora_adapter")
    @control_action("unload", adapter=lambda kw: kw["body"].lora_name)
    async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> dict:
        try:
            evicted = await _engine(request).unload_adapter(body.lora_name)
        except (CatalogError, EngineError) as exc:
            raise as_api_error(exc) from exc
        return {"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                "evicted": evicted}

    return router
