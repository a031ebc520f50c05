"""The Ray transport: the ingress's `EngineClient` over a Serve deployment handle. The FastAPI
app is served unchanged over the client, and everything a request meets before the engine
(validation, admission in tokens, resolving its adapter here: an unknown one is the usual 404
before any replica is asked) is the client's, as in one process.

- An `Add` streams the request from a replica Serve picks with the adapter id as the
  multiplexed model id (Serve's router prefers a replica that holds it); the replica hosts a
  `CoreClient` (ray_serve/replica.py), so its deltas come as text, straight to the request's
  queue (the client's `_put`). An `Abort` cancels the stream.
  A replica that dies before the first output is tried again once on another; one that dies
  mid-stream ends the request with one clean 503.
- Admission's slots are the live replicas' batches: past them requests wait here, by fair share
  in tokens, not in Serve's FIFO router queue.
- Calls: `Residency` and `Unload` are answered by every replica's engine core
  (`board.broadcast`: the core's own dispatch and live residency answer, as in one process),
  a revision's residency being the nearest the device any core says (`board.nearest`); `Warm`
  goes into the CPU tier of the replica that will serve the adapter next.
- The catalog is opened read-write here, the one writer (loads, promotes, the miss path);
  replicas open it read-only. Snapshots come from the replicas' reports (`board.ReplicaBoard`).
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

from ..adapters.limits import PoolLimits
from ..adapters.stats import CacheStats, PagerStats, PoolStats
from ..engine.client.frontend import Transport, unavailable_error
from ..engine.config import EngineConfig
from ..engine.messages import Abort, Add, Call, Message, Residency, Return, Unload, Warm
from ..engine.snapshot import EngineSnapshot
from ..engine.types import EngineError, RequestOutput, ResolvedModel
from ..engine.wire import error_from_wire, output_from_wire, request_to_wire, snapshot_from_wire
from .board import ReplicaBoard, merged, nearest
from .config import ScaleOutConfig

log = logging.getLogger(__name__)

RETRIES = 1                 # a replica that dies before the first output: tried again once
CONTROL_TIMEOUT_S = 120.0   # warm / residency / unload calls to replicas

# the engine replicas that served the current HTTP request (the x-loraserve-replica header)
served_by: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("served_by", default=None)


class RayTransport(Transport):
    trains = False  # training runs beside one resident base; not across replicas (yet)
    carries_blobs = False  # a replica pages its adapters in itself: the ingress reads records only

    def __init__(self, cfg: EngineConfig, replicas: DeploymentHandle, scale: ScaleOutConfig):
        self.cfg, self.scale, self.replicas = cfg, scale, replicas
        # the client's catalog is opened here, its one writer (the miss path runs here too);
        # replicas see its imports on their next read
        self.base_fingerprint = base_fingerprint(cfg.model_dir)
        self.board = ReplicaBoard(scale.stale_after_s)
        self._streams: dict[str, asyncio.Task] = {}  # request id -> its stream from a replica
        self._started = False

    # -- what the server reads -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Some engine replica reported lately (a replica reports only while its core is ready)."""
        return bool(self.board.live())

    @property
    def restarts(self) -> int:
        return self.board.lost

    def unavailable(self) -> EngineError:
        """The 503 while no replica has reported lately."""
        return unavailable_error("no engine replica has reported lately; retry later")

    def replica_snapshots(self) -> dict[str, EngineSnapshot]:
        """replica id -> its latest snapshot (router_metrics labels series by it)."""
        return self.board.live()

    @property
    def snapshot(self) -> EngineSnapshot:
        return merged(list(self.board.live().values()))

    def _replica_count(self) -> int:
        """The replicas that reported lately (those configured, before any has)."""
        return len(self.board.live()) or self.scale.replicas

    def slots(self) -> int:
        """The cluster's running slots: sequences wait here past them, not in Serve's FIFO."""
        return self._replica_count() * self.cfg.max_batch_size

    def queue_tokens(self) -> int:
        """What the replicas' queues would hold: max_waiting sequences of max_model_len each."""
        return self._replica_count() * self.cfg.max_waiting * self.client.max_model_len

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Learn the replicas' pool limits (what an adapter must fit to be served)."""
        if self._started:
            return
        info = await self.replicas.info.remote()
        if self.client.catalog is not None:
            self.client.catalog.learn(self.base_fingerprint,
                                      PoolLimits(info["max_rank"], tuple(info["kinds"])))
        self._started = True

    def report(self, replica_id: str, snapshot: dict, seen: int, results: dict) -> list:
        """A replica's periodic report (board.ReplicaBoard.report); snapshot in wire form."""
        snap = snapshot_from_wire(snapshot, PoolStats, CacheStats, PagerStats)
        return self.board.report(replica_id, snap, seen, results)

    # -- the transport --------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """Event loop: an Add streams from a replica, an Abort cancels that stream, a call runs
        against the replicas and is answered by one Return."""
        if isinstance(msg, Add):
            rid = msg.request.request_id
            self._streams[rid] = asyncio.ensure_future(self._serve(msg))
        elif isinstance(msg, Abort):
            task = self._streams.pop(msg.request_id, None)
            if task is not None:
                task.cancel()
        else:
            asyncio.ensure_future(self._answer(msg))

    async def _serve(self, msg: Add) -> None:
        """One request's deltas to its queue, its error as the last one (a lost replica: above)."""
        req, rid = msg.request, msg.request.request_id
        if req.resolved is None and msg.record is not None:  # an in-process caller's adapter
            rec = msg.record
            req.resolved = ResolvedModel(req.adapter, req.adapter, (rec.adapter_id, rec.revision),
                                         rec, req.tenant)
        adapter_id = None if msg.record is None else msg.record.adapter_id
        wire = request_to_wire(req, resolved=True)  # the replica runs this record, never resolves
        try:
            for attempt in range(RETRIES + 1):
                started = False
                try:
                    async for out in self._stream(wire, adapter_id):
                        started = True
                        self.client._put(out)
                    return
                except RayActorError as exc:
                    if started or attempt == RETRIES:
                        log.warning("request %s: engine replica lost (%s)", rid, exc)
                        raise unavailable_error("the engine replica serving this request "
                                                "stopped; retry it") from None
                    log.info("request %s: engine replica lost before its first output; retrying", rid)
        except Exception as exc:  # raised to the reader as it was raised here
            self.client._put(RequestOutput.failed(rid, exc))
        finally:
            if self._streams.get(rid) is asyncio.current_task():
                del self._streams[rid]

    async def _stream(self, wire: dict, adapter_id: str | None) -> AsyncIterator[RequestOutput]:
        """One try: the replica's output deltas; its errors raised as they were raised there.
        The replica is named in served_by once it answers (a lost one never is)."""
        handle = self.replicas.options(stream=True, multiplexed_model_id=adapter_id or "")
        gen = handle.generate.remote(wire)
        replica, answered, error = None, served_by.get(), None
        try:
            async for kind, value in gen:
                if kind == "replica":
                    replica = value
                    continue
                if answered is not None:
                    answered.add(replica)
                if kind == "error":  # (its last item)
                    error = error_from_wire(value)
                    break
                yield output_from_wire(value)
        except BackPressureError:
            raise EngineError("the server is at capacity (every engine replica's queue is full); "
                              "retry later", status=429, code="rate_limit_exceeded") from None
        except RayTaskError as exc:
            log.error("engine replica failed: %s", exc)
            raise EngineError("internal error in an engine replica", status=500,
                              code="internal_error") from None
        except BaseException:  # closed early (client gone) or the replica lost: it aborts the request
            gen.cancel()
            raise
        if error is not None:
            raise error

    # -- calls ----------------------------------------------------------------------------------
    async def _answer(self, msg: Call) -> None:
        try:
            ret = Return(msg.call_id, await asyncio.wait_for(self._run_call(msg), CONTROL_TIMEOUT_S))
        except Exception as exc:
            ret = Return(msg.call_id, None, exc)
        self.client._returned(ret)

    async def _run_call(self, msg: Call):
        if isinstance(msg, Residency):
            return nearest(list((await self.board.broadcast(msg, CONTROL_TIMEOUT_S)).values()))
        if isinstance(msg, Unload):
            return sum((await self.board.broadcast(msg, CONTROL_TIMEOUT_S)).values())
        if isinstance(msg, Warm):  # into the CPU tier of the replica Serve routes the adapter to
            rec = msg.record
            handle = self.replicas.options(multiplexed_model_id=rec.adapter_id)
            await handle.warm.remote(f"{rec.adapter_id}@{rec.revision}")
            return None
        raise EngineError(f"{type(msg).__name__} calls are not served behind Ray Serve "
                          "(training runs beside one engine)", status=501, code="not_implemented")

