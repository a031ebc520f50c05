"""An engine replica: one engine-core process over the server's EngineConfig, catalog read-only,
as a Ray Serve deployment.

The replica hosts the process transport (`CoreClient`: the `EngineClient` over a
`ProcessTransport`), as `loraserve serve` does, so it inherits its stall detection and
restart; while no core is ready the replica stops reporting
to the ingress (`_report_loop`), so the ingress's board drops it after `stale_after_s` and
/ready reads the engines' progress, not the replica's event loop. A supervisor that gave up
fails Serve's health check (`check_health`), and Serve replaces the replica.

Requests arrive through the ingress's deployment handle with the adapter id as Serve's
multiplexed model id. `load_adapter` (`@serve.multiplexed`, its capacity the engine's device
adapter slots) is what tells Serve's router which replica holds which adapter; it is cheap
(the engine pages the weights in itself, parking the request meanwhile) and evicts nothing
(the engine's device pool has its own LRU of the same size).

Streams carry plain lists, never engine objects: ["replica", id] first (the ingress's
x-loraserve-replica header), then ["out", delta] per output delta (engine.wire's form), or
["error", error] for an error the client is to see (a 4xx/5xx body).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from ray import serve

from loraserve.catalog.errors import CatalogError

from ..engine.client.core_client import CoreClient
from ..engine.config import EngineConfig
from ..engine.messages import Call, decode
from ..engine.types import EngineError
from ..engine.wire import error_to_wire, output_to_wire, request_from_wire, snapshot_to_wire
from .config import INGRESS_DEPLOYMENT, ScaleOutConfig

log = logging.getLogger(__name__)


async def load_adapter(self, adapter_id: str) -> str:
    """Serve's model "load" for an adapter: nothing to do (the engine pages weights in itself);
    what matters is that Serve now counts adapter_id as held here."""
    return adapter_id


class EngineReplica:
    """The deployment class (`replica_class` adds `load_adapter` with its capacity)."""

    async def __init__(self, engine_config: dict, scale: ScaleOutConfig):
        # the ingress runs the miss path and the durable tier (the catalog's one writer)
        cfg = EngineConfig(**{**engine_config, "catalog_readonly": True, "adapter_sources": [],
                              "catalog_store": None})
        self.engine = CoreClient(cfg, engine_timeout_s=scale.engine_timeout_s,
                                 start_timeout_s=scale.engine_start_timeout_s)
        await self.engine.start()
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.scale = scale
        self._ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT, ctx.app_name)
        self._seen = 0                       # the last broadcast command run
        self._results: dict[int, list] = {}  # its results, for the next report
        self._reporter = asyncio.create_task(self._report_loop())

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request: dict) -> AsyncIterator[list]:
        yield ["replica", self.replica_id]
        adapter_id = serve.get_multiplexed_model_id()
        if adapter_id:
            await self.load_adapter(adapter_id)
        try:
            async for out in self.engine.generate(request_from_wire(request)):
                yield ["out", output_to_wire(out)]
        except Exception as exc:
            if not isinstance(exc, (EngineError, CatalogError)):  # a bug: logged here, a 500 there
                log.exception("request %s failed", request.get("id"))
            yield ["error", error_to_wire(exc)]

    # -- control calls from the ingress ----------------------------------------------------------
    async def info(self) -> dict:
        """What the ingress checks adapters against: the pool's rank and target kinds, from the
        handshake of the core (up once `__init__` returned)."""
        info = self.engine.transport.core_info
        return {"max_rank": info.max_rank, "kinds": list(info.kinds)}

    async def core_pid(self) -> int | None:
        """The engine-core process serving here now (tests stop it to wedge this replica)."""
        return self.engine.core_pid

    async def check_health(self) -> None:
        """Serve's health check: unhealthy once the supervisor gave up on its engine core (a
        core that stalls or dies is replaced by the supervisor itself, without Serve)."""
        if self.engine.transport.state == "stopped":
            raise RuntimeError("the engine core's supervisor stopped")

    async def warm(self, ref: str) -> list[str]:
        """Page ref into the CPU tier (after /v1/load_lora_adapter); this replica now holds it."""
        await self.load_adapter(serve.get_multiplexed_model_id() or ref.split("@", 1)[0])
        return list(await asyncio.to_thread(self.engine.catalog.warm, ref))

    # -- reports to the ingress -----------------------------------------------------------------
    async def _report_loop(self) -> None:
        """Every report interval while the engine core is ready (up, beating and making
        progress; else none, see above): the snapshot and command results to the ingress; run
        the commands it hands back. Errors (the ingress restarting, say) are retried next time."""
        while True:
            try:
                if self.engine.ready:
                    sent, self._results = self._results, {}
                    commands = await self._ingress.report.remote(
                        self.replica_id, snapshot_to_wire(self.engine.snapshot), self._seen, sent)
                    for seq, call in commands:
                        await self._run_command(seq, call)
            except Exception as exc:  # (a cancel is no Exception: it ends the loop)
                log.debug("report to the ingress failed: %s", exc)
            await asyncio.sleep(self.scale.report_interval_s)

    async def _run_command(self, seq: int, call: list) -> None:
        """A call every replica answers (`board.broadcast`, in `engine.messages` wire form),
        answered by this replica's core (its one dispatch, `EngineCore`); the answer goes with
        the next report."""
        if seq <= self._seen:
            return
        self._seen = seq
        try:
            msg = decode(call)
            if not isinstance(msg, Call):
                raise EngineError(f"a replica command must be a call, got {type(msg).__name__}",
                                  status=500)
            self._results[seq] = ["ok", await self.engine.call(
                lambda cid: dataclasses.replace(msg, call_id=cid))]
        except Exception as exc:
            self._results[seq] = ["error", error_to_wire(exc)]

    async def __del__(self) -> None:
        self._reporter.cancel()
        await self.engine.shutdown()


def replica_class(max_adapters: int) -> type:
    """EngineReplica with `load_adapter` multiplexed over `max_adapters` adapters per replica
    (Serve's decorator takes its capacity at class definition; the engine's comes from config)."""
    load = serve.multiplexed(max_num_models_per_replica=max_adapters)(load_adapter)
    return type("EngineReplica", (EngineReplica,), {"load_adapter": load})
