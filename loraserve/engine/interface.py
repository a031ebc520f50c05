"""The engine as the server sees it: every member the HTTP side uses, in one Protocol.

One class implements it on every hosting, `client.frontend.EngineClient`, over a transport:
`ThreadTransport` (the engine on a thread of the API process: `AsyncEngine`), `ProcessTransport`
(an engine-core process: `CoreClient`) or `RayTransport` (Ray Serve replicas); the server's
tests use a fake with the same members. The server reads members, it never probes for them:
a part that only some hostings have is a member of all of them whose value says "not here".

Required:
    model_name, max_model_len, vocab_size, tokenizer, config     what is served, and how
    resolve(model, principal) -> ResolvedModel                  the edge's one resolver
    generate(request) -> async iterator of RequestOutput        one request's deltas
    stats() -> dict, list_models() -> list[str]                 gauges, the base and resident ids
    start(), shutdown()                                         lifecycle
Optional, explicit:
    ready: bool, unavailable() -> EngineError                   False / the 503 while no engine takes requests
    snapshot: EngineSnapshot | None                             None: no engine publishes one (a test double)
    replica_snapshots() -> dict | None                          per replica (Ray), None: one engine
    catalog: CatalogView | None                                 the adapter catalog, as the HTTP
                                                                side may use it; None: base only
    sourcing: object | None                                     fetches adapters the catalog lacks
                                                                (client/sourcing.py); None: no
                                                                --adapter-source / --catalog-store
    describe_adapter(id), unload_adapter(id)                    only with a catalog
    core_pid: int | None, supervision() -> dict | None          the engine-core process, None in process
    trainer: Trainer | None                                     training runs on the resident base
                                                                (engine/training.py); None: this
                                                                hosting does not train (Ray replicas)
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from ..adapters.limits import PoolLimits
from .snapshot import EngineSnapshot
from .training import Trainer
from .types import EngineError, GenerateRequest, RequestOutput, ResolvedModel


class CatalogView(Protocol):
    """The adapter catalog as the HTTP side uses it, the same on every hosting
    (`client.catalog_view.CatalogView`): the catalog itself (listings, imports, promotes: its
    own thread-safe reads and writes), what an import must fit (the served base's fingerprint,
    the engine's pool limits), and `warm`, a call to the engine. Nothing of the engine's own
    adapter tiers (device pool, CPU tier, pager) is reachable through it: those belong to the
    engine's thread, and the HTTP side reaches them only through calls."""

    catalog: Any
    base_fingerprint: str

    @property
    def pool(self) -> PoolLimits: ...

    def warm(self, ref: str) -> tuple[str, str]: ...


class EngineInterface(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    config: Any
    catalog: CatalogView | None
    sourcing: Any | None
    ready: bool
    snapshot: EngineSnapshot | None
    core_pid: int | None
    trainer: Trainer | None

    async def resolve(self, model: str, principal: Any) -> ResolvedModel: ...
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...
    def stats(self) -> dict[str, Any]: ...
    def list_models(self) -> list[str]: ...
    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
    def unavailable(self) -> EngineError: ...
    def replica_snapshots(self) -> dict[str, EngineSnapshot] | None: ...
    def supervision(self) -> dict | None: ...
    def describe_adapter(self, adapter_id: str) -> dict: ...
    async def unload_adapter(self, adapter_id: str) -> int: ...
