"""The API side of an engine: one `EngineClient` on every hosting, and its `Transport`.

`EngineClient` lives on the API server's event loop and owns everything every hosting shares.
It validates a request, admits it (`admission`: the bound on what is in flight and fair share,
in tokens, one implementation for every hosting), takes the revision its model was resolved to
at the edge (`GenerateRequest.resolved`, from `resolve`: the `AdapterDirectory`), sends it to
the engine core as an `Add` (`engine.messages`), turns the core's token-id deltas into text
deltas (`OutputProcessor`: detokenization, stop strings, merging a non-streamed request's
deltas) and hands each to the request's asyncio.Queue. Calls (unload, residency, warm, train)
are records with a call id, answered by one `Return` each (`call`). The catalog side (a
`CatalogView`, the directory, the miss path) and the trainer are its too.

A `Transport` only moves messages and says whether the core is there: `send(msg)` on the event
loop; the core's step deltas back to the client's `_deliver`, its returns to `_returned`; and
`start`, `shutdown`, `ready`, `unavailable`, `snapshot`, `restarts`, `core_pid`, `supervision`.
Three exist: `async_engine.ThreadTransport` (the core on a thread; `AsyncEngine` builds the
client over it), `core_client.ProcessTransport` (an engine-core process over a Unix socket,
supervised: heartbeat, stall detection, restart with backoff; `CoreClient`) and
`ray_serve.frontend.RayTransport` (a Serve deployment handle to engine replicas, which each
host a `CoreClient`, so their deltas come back as text, straight to the queues: `_put`). So
every hosting gives the same outputs and answers.
"""
from __future__ import annotations

import asyncio
import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

from ...model.config import ModelConfig
from ...tokenizer import Tokenizer
from ..config import EngineConfig
from ..directory import EVERYONE, AdapterDirectory, Viewer
from ..messages import Abort, Add, Call, Message, Residency, Return, Train, Unload, Warm
from .admission import Admission, cost
from .catalog_view import CatalogView
from .output_processor import OutputProcessor
from .sourcing import Sourcing
from .sourcing import resolve as resolve_model
from ..snapshot import EngineSnapshot
from ..training import Trainer
from ..types import EngineError, GenerateRequest, RequestOutput, ResolvedModel
from .warm_refs import WarmRefs

RETRY_AFTER_MAX_S = 60


def unavailable_error(message: str, retry_after_s: float = 1) -> EngineError:
    """A 503 engine_unavailable; its `retry_after` (whole seconds, 1 to RETRY_AFTER_MAX_S)
    becomes Retry-After."""
    err = EngineError(message, status=503, code="engine_unavailable")
    err.retry_after = min(RETRY_AFTER_MAX_S, max(1, math.ceil(retry_after_s)))
    return err


class Transport(ABC):
    """How an `EngineClient`'s messages reach its core and the core's come back (module doc).
    The defaults are an engine that is always there; a transport overrides what it knows."""

    client: EngineClient  # set by the client it carries for
    cfg: EngineConfig
    snapshot: EngineSnapshot  # the engine's latest published snapshot
    directory: AdapterDirectory | None = None  # the engine's own, where it runs in this process
    base_fingerprint = ""  # the served base's, where known before the core's handshake
    trains = True  # the core beside the model trains (`Train` calls); False: no trainer
    carries_blobs = True  # an `Add`'s blob reaches the core's page-in; False: the engine reads its own
    restarts = 0  # cores started again after one was lost
    core_pid: int | None = None  # the engine-core process; None: none of its own
    ready = True  # the engine can take requests now

    async def start(self) -> None:
        """Start carrying (idempotent; cheap once started: every request calls it)."""

    async def shutdown(self) -> None:
        """Stop carrying; what is in flight ends."""

    @abstractmethod
    def send(self, msg: Message) -> None:
        """Event loop: hand msg to the core (every transport's own)."""

    def unavailable(self) -> EngineError:
        """The 503 while `ready` is False (its `retry_after`, in seconds, becomes Retry-After)."""
        return unavailable_error("the engine is starting; retry later")

    def supervision(self) -> dict | None:
        """The engine-core supervisor's state (the process transport); None: none."""
        return None

    def replica_snapshots(self) -> dict[str, EngineSnapshot] | None:
        """One snapshot per engine replica (Ray Serve); None: one engine."""
        return None

    def slots(self) -> int:
        """Sequences past admission at once: the engine's batch and its queue (its scheduler
        orders them, in tokens)."""
        return self.cfg.max_batch_size + self.cfg.max_waiting

    def queue_tokens(self) -> int:
        """Tokens that may wait at admission: none here (the engine's queue is in `slots`)."""
        return 0


class EngineClient:
    """The one API-side engine client (module doc), over `transport`. Its model's name, sizes
    and tokenizer (unless given) are read from the model's directory (an unsupported model says
    so first)."""

    catalog: CatalogView | None  # the catalog side of the adapter tiers; None: base only
    sourcing: Sourcing | None  # adapters the catalog lacks, fetched on a miss; None: not configured
    trainer: Trainer | None  # training runs in the core, beside the model; None: not this hosting

    def __init__(self, transport: Transport, tokenizer=None) -> None:
        self.transport, transport.client = transport, self
        cfg = self.cfg = transport.cfg
        mc = ModelConfig.from_dir(cfg.model_dir)
        self.model_name, self.vocab_size = cfg.model_name, mc.vocab_size
        self.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(cfg.model_dir)
        # event loop only
        self._queues: dict[str, asyncio.Queue] = {}
        self._outputs = OutputProcessor(self.tokenizer)
        # requests between generate() and their last delta, in tokens per tenant (`admission`)
        self.admission = Admission(transport.slots, transport.queue_tokens)
        self._warm = WarmRefs()  # whether a ref is resolved inline or on a thread
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}  # call id -> its answer
        local = transport.directory
        if local is not None:  # a view of the engine's catalog (never its thread's AdapterManager)
            self.catalog = CatalogView(local, self._warm_on) if local.catalog is not None else None
        else:  # the engine elsewhere: its catalog opened here, its pool limits at its handshake
            self.catalog = CatalogView.open(
                cfg.catalog_dir, cfg.model_name, self._warm_on, transport.base_fingerprint,
                readonly=cfg.catalog_readonly) if cfg.catalog_dir else None
        self.directory = (local if local is not None else  # (the one resolver)
                          self.catalog.directory if self.catalog is not None
                          else AdapterDirectory(cfg.model_name))
        self.sourcing = Sourcing.open(cfg, self.catalog, self.directory)
        # a cold revision's blob, read with its record ahead of the request (shard hosts only),
        # where the transport takes it to the core
        carry = getattr(self.directory.catalog, "carry_blobs", None) if transport.carries_blobs else None
        self._carried = carry() if carry is not None else None
        # each training operation a `Train` call (a restarted core has no runs: the Tinker
        # routes put each back from the state they kept after its last step)
        self.trainer = Trainer(lambda op, args: self.call(lambda cid: Train(cid, op, tuple(args))),
                               cfg.train_max_tokens) if transport.trains else None

    def _warm_on(self, record) -> None:
        """Blocking (a worker thread): page `record` into the engine's CPU tier, a `Warm` call
        to the core (the catalog view's `warm_on` on every hosting)."""
        self.call_from_thread(lambda cid: Warm(cid, record))

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the transport (idempotent)."""
        self._loop = asyncio.get_running_loop()
        await self.transport.start()

    async def shutdown(self) -> None:
        """Stop the transport, then the catalog side here: the miss path and the catalog view."""
        await self.transport.shutdown()
        if self.sourcing is not None:
            self.sourcing.close()
        if self.catalog is not None:
            self.catalog.close()

    # -- calls ----------------------------------------------------------------------------------
    async def call(self, make: Callable[[int], Call]) -> Any:
        """Event loop: the call `make(call_id)` run by the core between steps; its value, or
        its error raised."""
        await self.start()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut = self._loop.create_future()
        self.transport.send(make(call_id))
        return await fut

    def call_from_thread(self, make: Callable[[int], Call], timeout: float = 120.0) -> Any:
        """`call` from a worker thread (blocking)."""
        return asyncio.run_coroutine_threadsafe(self.call(make), self._loop).result(timeout)

    def _returned(self, ret: Return) -> None:
        """Event loop: the core's answer to a call."""
        fut = self._calls.pop(ret.call_id, None)
        if fut is not None and not fut.done():
            if ret.error is None:
                fut.set_result(ret.value)
            else:
                fut.set_exception(ret.error)

    def describe_adapter(self, adapter_id: str) -> dict:
        """Blocking (a worker thread): policy record, revisions (catalog reads here) and each
        revision's residency (the core's answer: gpu, cpu, disk or quarantined)."""
        return self.catalog.describe(adapter_id, lambda key: self.call_from_thread(
            lambda cid: Residency(cid, (tuple(key),)))[0])

    async def unload_adapter(self, adapter_id: str) -> int:
        """Evict adapter_id's idle revisions from the device pool and the CPU tier (catalog
        errors, e.g. 404 for an unknown id, are raised before anything changes)."""
        await asyncio.to_thread(self.catalog.catalog.policy, adapter_id)
        return await self.call(lambda cid: Unload(cid, adapter_id))

    # -- what the server reads (the transport's answers) -----------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.cfg

    @property
    def ready(self) -> bool:
        return self.transport.ready

    def unavailable(self) -> EngineError:
        return self.transport.unavailable()

    @property
    def snapshot(self) -> EngineSnapshot:
        return self.transport.snapshot

    @property
    def restarts(self) -> int:
        return self.transport.restarts

    @property
    def core_pid(self) -> int | None:
        return self.transport.core_pid

    def supervision(self) -> dict | None:
        return self.transport.supervision()

    def replica_snapshots(self) -> dict[str, EngineSnapshot] | None:
        return self.transport.replica_snapshots()

    def stats(self) -> dict:
        return {**self.snapshot.stats(), "engine_restarts": self.restarts,
                "engine_ready": int(self.ready)}

    def list_models(self) -> list[str]:
        return [self.model_name, *self.snapshot.resident_ids()]

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """One request: checked, admitted, resolved if the edge did not, handed to the engine;
        its deltas."""
        await self.start()
        req.check(self.vocab_size, self.max_model_len)
        if req.request_id in self._queues:
            raise EngineError(f"duplicate request id {req.request_id!r}")
        done = False
        async with self.admission.hold(req.tenant, req.tenant_weight, cost(req)):
            try:
                if req.resolved is not None:  # decided at the edge: never resolved again
                    record = req.resolved.record
                else:  # an in-process caller that names the adapter only (tests, bench)
                    record = (await self.resolve(req.adapter, EVERYONE)).record if req.adapter else None
                q = self._queues[req.request_id] = asyncio.Queue()
                self._outputs.add(req)
                self._submit(req, record)
                while not done:
                    out = await q.get()
                    if out.error is not None:
                        done = True
                        raise out.error
                    done = out.finish_reason is not None
                    yield out
            finally:
                self._outputs.remove(req.request_id)
                if self._queues.pop(req.request_id, None) is not None and not done:
                    self.transport.send(Abort(req.request_id))  # nobody waits for it any more

    def _submit(self, req: GenerateRequest, record) -> None:
        """Hand req (on revision `record`, None = base) to the engine, with the revision's blob
        when its resolve read it (`IsolatedCatalog.take_carried`)."""
        blob = self._carried(record) if record is not None and self._carried is not None else None
        self.transport.send(Add(req, record, blob))

    async def resolve(self, model: str, principal: Viewer) -> ResolvedModel:
        """`directory.resolve(model, principal)`, a name the catalog lacks fetched from the
        durable tier and the adapter sources (`sourcing.resolve`)."""
        return await resolve_model(self._warm, self.directory, self.sourcing, model, principal)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Event loop: the engine's token-id deltas of one step -> text deltas, each handed to
        its request's queue (gone requests are skipped); requests a stop string ended are
        aborted in the engine, which frees what they hold there."""
        ready, ended = self._outputs.process(outs)
        for out in ready:
            self._put(out)
        for request_id in ended:
            self.transport.send(Abort(request_id))

    def _put(self, out: RequestOutput) -> None:
        """Event loop: a text delta to its request's queue (gone requests are skipped)."""
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)

    def _fail_all(self, err: EngineError) -> None:
        """Event loop: end every request in flight and every call waiting for the core with err
        (one clean error each), and abort the requests (a core that is gone takes none): the
        core is gone, or stalled."""
        for rid in list(self._queues):
            self._put(RequestOutput.failed(rid, err))
            self.transport.send(Abort(rid))
        for call_id in list(self._calls):
            self._returned(Return(call_id, None, err))
