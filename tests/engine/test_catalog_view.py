"""What the HTTP side gets of the adapter tiers is a `CatalogView` on every hosting (issue 44):
in process too it is a view of the engine's catalog and directory, never the engine thread's
`AdapterManager`, and warming a revision is a `Warm` call the engine core runs."""
from __future__ import annotations

import asyncio

from loraserve.adapters.limits import PoolLimits
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.client.catalog_view import CatalogView
from loraserve.engine.config import EngineConfig
from loraserve.engine.core.build import build_engine
from serve_process import build_served


def test_the_in_process_hosting_hands_the_http_side_a_view_and_warms_through_the_core(tmp_path) -> None:
    base, catalog = build_served(tmp_path)
    engine = AsyncEngine(build_engine(EngineConfig(
        model_dir=str(base), catalog_dir=str(catalog), device="cpu", dtype="float32",
        max_model_len=256, max_batch_size=2, torch_threads=1)))
    manager = engine.transport.engine.adapters
    view = engine.catalog
    assert isinstance(view, CatalogView) and view is not manager
    assert view.catalog is manager.catalog and view.directory is engine.directory
    assert view.pool == manager.pool.limits and isinstance(view.pool, PoolLimits)
    assert view.base_fingerprint == manager.base_fingerprint

    async def run() -> tuple[str, tuple[str, str], str]:
        await engine.start()
        try:
            before = (await asyncio.to_thread(engine.describe_adapter, "acme/a"))["residency"]
            key = await asyncio.to_thread(view.warm, "acme/a")  # a Warm call, from a worker thread
            after = (await asyncio.to_thread(engine.describe_adapter, "acme/a"))["residency"]
            return before, key, after
        finally:
            await engine.shutdown()

    before, key, after = asyncio.run(run())
    assert (before, after) == ("disk", "cpu"), (before, after)
    assert key[0] == "acme/a" and key in manager.cpu_cache.keys()
