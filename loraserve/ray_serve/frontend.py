"""The ingress's engine facade: the FastAPI app is served unchanged over it, generation goes to
the engine replicas through a Serve deployment handle.

`RayEngineFrontend` has the surface the app reads of `AsyncEngine`/`CoreClient` (model sizes,
tokenizer, `generate`, `stats`, `snapshot`, `list_models`, `adapter_manager`, ...), so every
route, auth and tenant check and error body is the single process's. What differs:

- `generate` resolves the request's adapter in the ingress (unknown: the usual 404 before any
  replica is asked), then streams from a replica chosen by Serve with the adapter id as the
  multiplexed model id: Serve's router prefers a replica that holds the adapter, and spills to
  another when those are full. Base-only requests carry no model id and go anywhere.
- A replica that dies before the first output is retried once on another; one that dies
  mid-stream ends the request with one clean 503 (a stream gets its error event and [DONE]).
- Sequences go to the replicas while the cluster has running slots; past that they wait here
  and free slots go to tenants by weighted fair share across the whole cluster (fair.py).
- The catalog is opened read-write here, the one writer (`/v1/load_lora_adapter`, promote,
  rollback, and the miss path: `--adapter-source`, `--catalog-store`); replicas open it
  read-only and see each commit in their next read.
- Snapshots come from the replicas' reports (`board.ReplicaBoard`), one per replica; /metrics
  labels each replica's series with `replica`.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from loraserve.catalog.base import base_fingerprint

from ..adapters.pool import PoolLimits
from ..adapters.stats import CacheStats, PagerStats, PoolStats
from ..engine.client.catalog_view import CatalogView
from ..engine.client.sourcing import Sourcing
from ..engine.client.sourcing import resolve as resolve_model
from ..engine.config import EngineConfig
from ..engine.directory import EVERYONE, AdapterDirectory
from ..engine.snapshot import EngineSnapshot
from ..engine.types import EngineError, GenerateRequest, RequestOutput, ResolvedModel
from ..engine.client.warm_refs import WarmRefs
from ..engine.wire import error_from_wire, output_from_wire, request_to_wire, snapshot_from_wire
from ..model.config import ModelConfig
from ..tokenizer import Tokenizer
from .board import ReplicaBoard, merged
from .fair import FairGate
from .config import ScaleOutConfig

log = logging.getLogger(__name__)

RETRIES = 1                 # a replica that dies before the first output: tried again once
CONTROL_TIMEOUT_S = 120.0   # warm / residency / unload calls to replicas

# the engine replicas that served the current HTTP request (the x-loraserve-replica header)
served_by: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("served_by", default=None)


def replica_lost() -> EngineError:
    return EngineError("the engine replica serving this request stopped; retry it", status=503,
                       code="engine_unavailable")


class RayEngineFrontend:
    def __init__(self, cfg: EngineConfig, replicas: DeploymentHandle, scale: ScaleOutConfig):
        self.cfg = cfg
        self.scale = scale
        self.replicas = replicas
        mc = ModelConfig.from_dir(cfg.model_dir)
        self.model_name = cfg.model_name
        self.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        self.tokenizer = Tokenizer.from_dir(cfg.model_dir)
        self.adapter_manager = CatalogView(cfg.catalog_dir, self.model_name, self._warm_on,
                                           base_fingerprint(cfg.model_dir)) if cfg.catalog_dir else None
        self.directory = (self.adapter_manager.directory if self.adapter_manager is not None
                          else AdapterDirectory(self.model_name))
        # the miss path runs here, the catalog's one writer; replicas see its imports on their next read
        self.sourcing = Sourcing.open(cfg, self.adapter_manager, self.directory)
        self._warm = WarmRefs()
        self.board = ReplicaBoard(scale.stale_after_s)
        self.gate = FairGate(lambda: self._replica_count() * cfg.max_batch_size,
                             lambda: self._replica_count() * cfg.max_waiting)
        self._started = False

    # -- what the server reads -------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.cfg

    @property
    def ready(self) -> bool:
        """Some engine replica reported lately."""
        return bool(self.board.live())

    core_pid = None  # engines run in replicas: no engine-core process of this one

    def _replica_count(self) -> int:
        """The replicas that reported lately (those configured, before any has)."""
        return len(self.board.live()) or self.scale.replicas
    trainer = None  # training runs beside one resident base; not across replicas (yet)

    def supervision(self) -> dict | None:
        """Replicas are Ray Serve's to supervise: None."""
        return None

    def unavailable(self) -> EngineError:
        """The 503 while no replica has reported lately."""
        err = EngineError("no engine replica has reported lately; retry later", status=503,
                          code="engine_unavailable")
        err.retry_after = 1
        return err

    def replica_snapshots(self) -> dict[str, EngineSnapshot]:
        """replica id -> its latest snapshot (router_metrics labels series by it)."""
        return self.board.live()

    @property
    def snapshot(self) -> EngineSnapshot:
        return merged(list(self.board.live().values()))

    def stats(self) -> dict:
        return {**self.snapshot.stats(), "engine_ready": int(self.ready),
                "engine_restarts": self.board.lost}

    def list_models(self) -> list[str]:
        return [self.model_name, *self.snapshot.resident_ids()]

    def residency(self, key: tuple[str, str]) -> str:
        """Blocking: gpu when a replica holds the revision in its device pool; else what the
        replica Serve routes the adapter to says (cpu or disk)."""
        if any(s.quarantine_reason(key) is not None for s in self.board.live().values()):
            return "quarantined"
        if any(key in s.resident for s in self.board.live().values()):
            return "gpu"
        handle = self.replicas.options(multiplexed_model_id=key[0])
        return handle.residency.remote(list(key)).result(timeout_s=CONTROL_TIMEOUT_S)

    def describe_adapter(self, adapter_id: str) -> dict:
        return self.adapter_manager.describe(adapter_id, self.residency)

    async def unload_adapter(self, adapter_id: str) -> int:
        """Evict adapter_id's idle revisions on every replica (404 first for an unknown id)."""
        await asyncio.to_thread(self.adapter_manager.catalog.policy, adapter_id)
        results = await self.board.broadcast("unload_adapter", [adapter_id], CONTROL_TIMEOUT_S)
        return sum(results.values())

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Learn the replicas' pool limits (what an adapter must fit to be served)."""
        if self._started:
            return
        info = await self.replicas.info.remote()
        if self.adapter_manager is not None:
            self.adapter_manager.learn(self.adapter_manager.base_fingerprint,
                                       PoolLimits(info["max_rank"], tuple(info["kinds"])))
        self._started = True

    async def shutdown(self) -> None:
        if self.sourcing is not None:
            self.sourcing.close()
        if self.adapter_manager is not None:
            self.adapter_manager.close()

    def report(self, replica_id: str, snapshot: dict, seen: int, results: dict) -> list:
        """A replica's periodic report (board.ReplicaBoard.report); snapshot in wire form."""
        snap = snapshot_from_wire(snapshot, PoolStats, CacheStats, PagerStats)
        return self.board.report(replica_id, snap, seen, results)

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        await self.start()
        req.check(self.vocab_size, self.max_model_len)
        if req.resolved is None:  # an in-process caller naming its adapter only
            req.resolved = await self.resolve(req.adapter or self.model_name, EVERYONE)
        adapter_id = None if req.resolved.is_base else req.resolved.adapter[0]
        wire = request_to_wire(req, resolved=True)  # the replica runs this record, never resolves
        async with self.gate.slot(req.tenant, req.tenant_weight):  # the cluster's fair share
            async for out in self._tries(req, wire, adapter_id):
                yield out

    async def _tries(self, req: GenerateRequest, wire: dict,
                     adapter_id: str | None) -> AsyncIterator[RequestOutput]:
        """The request on a replica; once more on another when its replica dies before the first
        output, else one clean 503."""
        for attempt in range(RETRIES + 1):
            started = False
            try:
                async for out in self._stream(wire, adapter_id):
                    started = True
                    yield out
                return
            except RayActorError as exc:
                if started or attempt == RETRIES:
                    log.warning("request %s: engine replica lost (%s)", req.request_id, exc)
                    raise replica_lost() from None
                log.info("request %s: engine replica lost before its first output; retrying",
                         req.request_id)

    async def _stream(self, wire: dict, adapter_id: str | None) -> AsyncIterator[RequestOutput]:
        """One try: the replica's output deltas; its errors raised as they were raised there.
        The replica is named in served_by once it answers (a lost one never is)."""
        handle = self.replicas.options(stream=True, multiplexed_model_id=adapter_id or "")
        gen = handle.generate.remote(wire)
        finished = False
        replica, answered = None, served_by.get()
        try:
            async for kind, value in gen:
                if kind == "replica":
                    replica = value
                    continue
                if answered is not None:
                    answered.add(replica)
                if kind == "error":
                    finished = True
                    raise error_from_wire(value)
                yield output_from_wire(value)
            finished = True
        except BackPressureError:
            finished = True
            raise EngineError("the server is at capacity (every engine replica's queue is full); "
                              "retry later", status=429, code="rate_limit_exceeded") from None
        except RayTaskError as exc:
            finished = True
            log.error("engine replica failed: %s", exc)
            raise EngineError("internal error in an engine replica", status=500,
                              code="internal_error") from None
        finally:
            if not finished:  # closed early (client gone) or failed: the replica aborts it
                gen.cancel()

    async def resolve(self, model: str, principal) -> ResolvedModel:
        """`directory.resolve(model, principal)`, a name the catalog lacks fetched from the
        durable tier and the adapter sources (`sourcing.resolve`)."""
        return await resolve_model(self._warm, self.directory, self.sourcing, model, principal)

    def _warm_on(self, rec) -> None:
        """Blocking: page `rec` into the CPU tier of the replica Serve routes its adapter to (the
        one that will serve it next)."""
        handle = self.replicas.options(multiplexed_model_id=rec.adapter_id)
        handle.warm.remote(f"{rec.adapter_id}@{rec.revision}").result(timeout_s=CONTROL_TIMEOUT_S)
