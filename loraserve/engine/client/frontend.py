"""The request side of an engine, shared by every hosting.

`EngineFrontend` is the API side's one engine client; it lives on the API server's event loop.
It validates a request, admits it (`admission`: the bound on what is in flight and fair share,
in tokens, one implementation for every hosting), takes the revision its model was resolved to
at the edge (`GenerateRequest.resolved`, from `resolve`: the `AdapterDirectory`), sends it to
the engine core as an `Add` (`engine.messages`), turns the core's token-id deltas into text
deltas (`OutputProcessor`: detokenization, stop strings, merging a non-streamed request's
deltas) and hands each to the request's asyncio.Queue. Calls (unload, residency, warm, train)
are records with a call id, answered by one `Return` each (`call`). A subclass is only the
transport: how a message reaches the core (`_send`) and how the core's messages come back (to
`_deliver` and `_returned`): `AsyncEngine` over a thread, `CoreClient` over a Unix socket to an
engine-core process, `ray_serve.frontend.RayEngineFrontend` over a Serve deployment handle to
engine replicas (which host `CoreClient`, so their deltas come back as text, to the queues).
Everything else is this class's, so every hosting gives the same outputs and answers.
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


class EngineFrontend(ABC):
    cfg: EngineConfig
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object
    directory: AdapterDirectory  # what a request's model names (the one resolver; subclasses make it)

    def __init__(self, tokenizer=None, cfg: EngineConfig | None = None) -> None:
        """`tokenizer`, or with `cfg` alone (a hosting whose engine is elsewhere) the model's
        name, sizes and tokenizer read from its directory (an unsupported model says so first)."""
        if cfg is not None:
            mc = ModelConfig.from_dir(cfg.model_dir)
            self.cfg, self.model_name, self.vocab_size = cfg, cfg.model_name, mc.vocab_size
            self.max_model_len = min(cfg.max_model_len, mc.max_position_embeddings)
            if tokenizer is None:
                tokenizer = Tokenizer.from_dir(cfg.model_dir)
        self.tokenizer = tokenizer
        # event loop only
        self._queues: dict[str, asyncio.Queue] = {}
        self._outputs = OutputProcessor(tokenizer)
        # requests between generate() and their last delta, in tokens per tenant (`admission`)
        self.admission = Admission(self._slots, self._queue_tokens)
        self._warm = WarmRefs()  # whether a ref is resolved inline or on a thread
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}  # call id -> its answer

    def _open_catalog(self, base_fingerprint: str = "") -> None:
        """The catalog side where the engine is elsewhere: a `CatalogView` of cfg's catalog,
        opened here, the directory and the miss path."""
        cfg = self.cfg
        self.catalog = CatalogView.open(
            cfg.catalog_dir, self.model_name, self._warm_on, base_fingerprint,
            readonly=cfg.catalog_readonly) if cfg.catalog_dir else None
        self.directory = (self.catalog.directory if self.catalog is not None
                          else AdapterDirectory(self.model_name))
        self.sourcing = Sourcing.open(cfg, self.catalog, self.directory)

    def _warm_on(self, record) -> None:
        """Blocking (a worker thread): page `record` into the engine's CPU tier, a `Warm` call
        to the core (the catalog view's `warm_on` on every hosting)."""
        self.call_from_thread(lambda cid: Warm(cid, record))

    def _trainer(self) -> Trainer:
        """Training runs in the core, beside the model: each operation a `Train` call."""
        return Trainer(lambda op, args: self.call(lambda cid: Train(cid, op, tuple(args))),
                       self.cfg.train_max_tokens)

    # -- hosting (subclasses) --------------------------------------------------------------------
    @abstractmethod
    async def start(self) -> None:
        """Start hosting the engine (idempotent)."""

    async def shutdown(self) -> None:
        """Stop hosting the engine (a subclass stops its transport first), then the catalog
        side here: the miss path and the catalog view."""
        if self.sourcing is not None:
            self.sourcing.close()
        if self.catalog is not None:
            self.catalog.close()

    @abstractmethod
    def _send(self, msg: Message) -> None:
        """Event loop: hand msg to the core (the transport). The core's deltas come back to
        `_deliver`, its returns to `_returned`."""

    def _submit(self, req: GenerateRequest, record) -> None:
        """Hand req (on revision `record`, None = base) to the engine."""
        self._send(Add(req, record))

    # -- calls ----------------------------------------------------------------------------------
    async def call(self, make: Callable[[int], Call]) -> Any:
        """Event loop: the call `make(call_id)` run by the core between steps; its value, or
        its error raised."""
        await self.start()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut = self._loop.create_future()
        self._send(make(call_id))
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

    @property
    @abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The engine's latest published snapshot."""

    # -- what the server reads -------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.cfg

    restarts = 0  # engine-core processes started again after one died (CoreClient)

    @property
    def ready(self) -> bool:
        """The engine can take requests now (an in-process engine always can)."""
        return True

    def unavailable(self) -> EngineError:
        """The 503 while `ready` is False (its `retry_after`, in seconds, becomes Retry-After)."""
        return unavailable_error("the engine is starting; retry later")

    # the optional parts of `interface.EngineInterface`, "not here" unless a hosting has them
    catalog: CatalogView | None = None  # the catalog side of the adapter tiers; None: base only
    sourcing = None  # client.sourcing.Sourcing: adapters the catalog lacks, fetched on a miss
    core_pid: int | None = None  # the engine-core process (CoreClient)

    def supervision(self) -> dict | None:
        """The engine-core supervisor's state (CoreClient); None in process."""
        return None

    def replica_snapshots(self) -> dict[str, EngineSnapshot] | None:
        """One snapshot per engine replica (Ray Serve); None: one engine."""
        return None

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
                    self._send(Abort(req.request_id))  # nobody waits for it any more

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
            self._send(Abort(request_id))

    def _put(self, out: RequestOutput) -> None:
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)

    def _fail_all(self, err: EngineError) -> None:
        """Event loop: end every request in flight and every call waiting for the core with err
        (one clean error each), and abort the requests (a core that is gone takes none): the
        core is gone, or stalled."""
        for rid in list(self._queues):
            self._put(RequestOutput.failed(rid, err))
            self._send(Abort(rid))
        for call_id in list(self._calls):
            self._returned(Return(call_id, None, err))

    def _slots(self) -> int:
        """Sequences past admission at once: the engine's batch and its queue (its scheduler
        orders them, in tokens)."""
        return self.cfg.max_batch_size + self.cfg.max_waiting

    def _queue_tokens(self) -> int:
        """Tokens that may wait at admission: none here (the engine's queue is in `_slots`)."""
        return 0
