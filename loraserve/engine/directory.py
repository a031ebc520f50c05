"""AdapterDirectory: what a request's `model` names, decided once, at the edge, for one principal.

    model (as the client wrote it)
      -> name: a recorded alias (`tinker://<run>/sampler_weights/<ckpt>`), `tinker://tenant/name`,
         `tinker://<base>`, the base's served name, or `tenant/name[@rev]`; a name without a
         tenant (vLLM's `sql-lora`) is the default tenant's (`default/sql-lora`)
      -> visibility: the principal must see the adapter's tenant
      -> the revision record (promoted, or the `@rev` / tag asked for), built for the served base
         (409 otherwise) and within this server's pool limits (400 otherwise)
      = ResolvedModel(name, adapter key, record, tenant)

The API process owns it (`EngineClient.directory`: in process, with an engine-core process,
behind Ray Serve alike); a `GenerateRequest` carries the `ResolvedModel` down and the engine
runs the record it holds, never resolving again, so a promote between the two cannot change
what a request runs. The principal is a required argument (anything with `sees(tenant)`; a
server without keys passes its open principal): there is no ambient "current request" to fall
back on, so a caller that forgets it fails loudly instead of seeing every tenant.

Every name the principal may not see answers exactly as a name that names nothing: the same
404 (`model_not_found`, `param` "model", the message echoing the name as the request gave it),
never naming what an alias resolved to. A revision or tag that does not exist of an adapter the
principal may see is still `revision_not_found` (it may know the adapter exists).
"""
from __future__ import annotations

from typing import Protocol

from loraserve.catalog.aliases import is_alias, lookup_alias
from loraserve.catalog.errors import AdapterNotFound, InvalidAdapterId
from loraserve.catalog.ids import parse_model_ref, with_default_tenant

from ..adapters.limits import PoolLimits, check_base
from .types import EngineError, ResolvedModel

TINKER_SCHEME = "tinker://"
ECHO_MAX = 256  # characters of a requested name echoed in an error


class Viewer(Protocol):
    """Who asks: the server's principal (`loraserve.keys.Principal`) or anything that says which
    tenants' adapters it may see, and which tenant a base-model request of its is charged to."""

    @property
    def home_tenant(self) -> str: ...

    def sees(self, tenant: str) -> bool: ...


class Everyone:
    """The principal of in-process callers with no keys at all (tests, bench, `LLMEngine.add_request`)."""

    home_tenant = ""

    def sees(self, tenant: str) -> bool:
        return True


EVERYONE = Everyone()


def clip(value: str, limit: int = ECHO_MAX) -> str:
    """`value` cut to `limit` characters (an ellipsis marks the cut)."""
    return value if len(value) <= limit else value[:limit - 1] + "\u2026"


def not_found(requested: str) -> EngineError:
    """The one answer to a name that names nothing the principal may see (module doc)."""
    return EngineError(f"The model `{clip(requested)}` does not exist.", status=404,
                       code="model_not_found", param="model")


class AdapterDirectory:
    """Resolves `model` names against a catalog (None: the base only) for the served base.

    `limits` are the device pool's (rank, targets), known once an engine reports them: until
    then (`PoolLimits(0, ())`) nothing but the base resolves. Thread-safe: the catalog is."""

    def __init__(self, base_name: str, catalog=None, base_fingerprint: str = "",
                 limits: PoolLimits | None = None) -> None:
        self.base_name = base_name
        self.catalog = catalog
        self.base_fingerprint = base_fingerprint
        self.limits = limits if limits is not None else PoolLimits(0, ())

    def canonical(self, model: str) -> str:
        """The loraserve name `model` stands for (an alias's revision, `tinker://` cut off)."""
        if not is_alias(model):
            return model if model == self.base_name else with_default_tenant(model)
        if self.catalog is not None and (ref := lookup_alias(self.catalog, model)) is not None:
            return ref
        return model.removeprefix(TINKER_SCHEME)

    def resolve(self, model: str, principal: Viewer) -> ResolvedModel:
        """`model` decided for `principal` (module doc). Blocking: catalog reads (an alias, the
        revision). Raises EngineError 404 / 400, or the catalog's errors (409, 503, ...)."""
        if principal is None:
            raise TypeError("AdapterDirectory.resolve needs the principal the request acts for")
        name = self.canonical(model)
        if name == self.base_name:  # the base: the tenant of the key that asks
            return ResolvedModel(model, name, tenant=principal.home_tenant)
        try:
            adapter_id, revision = parse_model_ref(name)
        except InvalidAdapterId:
            raise not_found(model) from None
        tenant = adapter_id.split("/", 1)[0]
        if not principal.sees(tenant) or self.catalog is None:
            raise not_found(model)
        try:
            record = self.catalog.resolve(adapter_id, revision)
        except AdapterNotFound:
            raise not_found(model) from None
        check_base(record.ref, record.base_fingerprint, self.base_fingerprint)  # 409
        try:
            self.limits.check_admissible(record.rank, record.targets)
        except ValueError as exc:  # rank above --max-lora-rank, a target this server does not serve
            raise EngineError(f"adapter {record.ref} cannot be served here: {exc}", status=400,
                              param="model") from exc
        return ResolvedModel(model, record.ref, (record.adapter_id, record.revision), record, tenant)
