"""Tenants on the HTTP side: who a request acts for, what it may see and use, what it is charged.

- `Tenancy` owns the app's keys (an immutable KeyStore, swapped whole on reload), the limiter,
  the per-tenant counters and the audit log. Event loop only.
- `AuthMiddleware` turns the key a request presents (`Authorization: Bearer` or `X-API-Key`)
  into its Principal before anything else runs: 401 without a valid key, 403 for a user key on
  /admin/* or /metrics. /health, /ready, /openapi.json and the Tinker SDK's healthz and
  client/config stay open; so does everything when the server has no keys at all. A JWT minted
  for a key (tokens.py) is that key, wherever a key is accepted. The principal is `request.state.principal`, and for the
  generation path (which has no request object) the request's `RequestTenancy` is a ContextVar.
- Another tenant's adapter is answered exactly as an id that does not exist (`hidden`, which is
  names.not_found of the name as requested), by generation, listing, /v1/models/{id},
  /v1/adapters/{id} and the control routes alike: same status, code and message, never naming
  what an alias resolved to.
- `admit` is a generation request's admission: its tenant (the adapter's, else the key's first),
  the tenant's limits (all its keys together) and the key's own (429), the 404 above, and an
  engine view that tags each GenerateRequest with the tenant and its weight and counts its
  tokens for the tenant (and for the token buckets, which get back what was not computed).
"""
from __future__ import annotations

import hmac
import inspect
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.catalog.errors import InvalidAdapterId
from loraserve.catalog.ids import parse_model_ref, validate_adapter_id
from loraserve.engine.types import EngineError, GenerateRequest, RequestOutput, ResolvedModel
from loraserve.keys import (ALL_TENANTS, OPEN, KeyEntry, KeyFileError, KeyStore, Principal,
                            digest, load_keys)
from loraserve.server.audit_log import FAILED, AuditLog
from loraserve.server.errors import APIError
from loraserve.server.limits import Lease, LimitExceeded, Limiter, TenantCounters
from loraserve.server.metrics import ServerMetrics
from loraserve.server.names import not_found
from loraserve.server.request_log import current_record
from loraserve.server.tokens import TokenIssuer, looks_like_jwt

# the Tinker SDK's probes: it asks for its config before it has a token (server/tinker.py)
OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json", "/api/v1/healthz",
                        "/api/v1/client/config"})
# what an admin or the metrics key may read, routers' state (open where /metrics is open)
METRICS_PATHS = frozenset({"/metrics", "/v1/residency"})
API_KEY_ID = "api-key"  # the key id of --api-key in audit lines
NOBODY = Principal(key_id=None, admin=False, tenants=())  # an unauthenticated caller


@dataclass(slots=True)
class TenancyConfig:
    """Keys and logs of one server. No api_key and no keys_file: every route is open."""

    api_key: str | None = None              # one admin key (--api-key, $LORASERVE_API_KEY)
    keys_file: Path | None = None           # --keys: the TOML keys file (loraserve/keys.py)
    metrics_key: str | None = None          # --metrics-key: may read /metrics, nothing else
    audit_log: Path | None = None           # --audit-log: control-plane actions, JSON lines

    def __post_init__(self) -> None:
        self.api_key = self.api_key or None
        self.metrics_key = self.metrics_key or None
        self.keys_file = None if self.keys_file is None else Path(self.keys_file)
        self.audit_log = None if self.audit_log is None else Path(self.audit_log)

    @property
    def guarded(self) -> bool:
        """Whether requests need a key."""
        return self.api_key is not None or self.keys_file is not None

    @property
    def metrics_guarded(self) -> bool:
        """Whether /metrics needs an admin or the metrics key (with a keys file, or a metrics
        key; a server with only --api-key keeps /metrics open, as before tenants)."""
        return self.keys_file is not None or self.metrics_key is not None


class Tenancy:
    """The app's keys, limits, per-tenant counters and audit log (see module doc)."""

    def __init__(self, config: TenancyConfig, metrics: ServerMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.keys = self._read_keys()  # KeyFileError: the server does not start
        self._metrics_digest = None if config.metrics_key is None else digest(config.metrics_key)
        self.limiter = Limiter(clock)
        self.counters = TenantCounters(metrics)
        self.audit = AuditLog(config.audit_log)
        self.tokens = TokenIssuer()  # JWTs standing for keys (POST /api/v1/auth/token)

    def find(self, key: str | None) -> Principal | None:
        """The principal of an API key, or of a valid token minted for one; None if neither."""
        if key is None:
            return None
        found = self.keys.find(key)
        if found is None and looks_like_jwt(key):
            found = self.tokens.principal(key, self.keys)
        return found

    def _read_keys(self) -> KeyStore:
        cfg = self.config
        store = KeyStore() if cfg.keys_file is None else load_keys(cfg.keys_file)
        if cfg.api_key is None:
            return store
        try:
            api_key = KeyEntry(Principal(API_KEY_ID, admin=True), digest(cfg.api_key))
            return store.with_entry(api_key)
        except ValueError:
            raise KeyFileError(f"keys file {cfg.keys_file}: holds the --api-key") from None

    def reload_keys(self, key_id: str | None) -> KeyStore:
        """Re-read the keys file and swap the new store in (requests in flight keep the
        principal they have). On any error the old store stays and KeyFileError says why."""
        try:
            if self.config.keys_file is None:
                raise KeyFileError("this server has no keys file (start it with --keys FILE)")
            store = self._read_keys()
        except KeyFileError as exc:
            self.audit.record(key=key_id, action="reload-keys", outcome=FAILED, status=400,
                              error=str(exc))
            raise
        self.keys = store
        self.audit.record(key=key_id, action="reload-keys")
        return store

    def caller(self, path: str, method: str, key: str | None) -> Principal:
        """The principal a request to `path` acts for, or the APIError (401/403) refusing it."""
        cfg = self.config
        if not (cfg.guarded or cfg.metrics_guarded):
            return OPEN
        principal = self.find(key)
        if path in METRICS_PATHS and cfg.metrics_guarded:
            if (principal is not None and principal.admin) or self._is_metrics_key(key):
                return principal or NOBODY
            raise forbidden(f"{path} needs an admin key or the metrics key") \
                if principal is not None else unauthorized()
        if method == "OPTIONS" or path in OPEN_PATHS or path in METRICS_PATHS:
            return principal or NOBODY
        if not cfg.guarded:
            return OPEN
        if principal is None:
            raise unauthorized()
        if _under(path, "/admin") and not principal.admin:
            raise forbidden("this route needs an admin key")
        return principal

    def _is_metrics_key(self, key: str | None) -> bool:
        return (key is not None and self._metrics_digest is not None
                and hmac.compare_digest(digest(key), self._metrics_digest))


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' or "
                    "'X-API-Key: <key>'", code="invalid_api_key")


def forbidden(message: str) -> APIError:
    return APIError(403, f"Forbidden: {message}", code="forbidden")


def presented_key(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The key of `Authorization: Bearer <key>`, else of `X-API-Key: <key>`; None if neither."""
    found = dict(headers)
    scheme, _, value = found.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = found.get(b"x-api-key", b"").decode("latin-1").strip()
    return key or None


# -- one request -------------------------------------------------------------------------------

@dataclass(slots=True)
class RequestTenancy:
    """One HTTP request's principal and the leases it holds until it ends."""

    tenancy: Tenancy
    principal: Principal
    leases: list[Lease] = field(default_factory=list)

    def release(self) -> None:
        for lease in self.leases:
            lease.release()


_CURRENT: ContextVar[RequestTenancy | None] = ContextVar("loraserve_request_tenancy",
                                                         default=None)


class AuthMiddleware:
    """Resolve each HTTP request's principal (`Tenancy.caller`) before the app sees it; release
    what the request held (sequences in flight) as its response's last body message goes out,
    streamed or not, and in any case when the app returns (an error, a client gone)."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy):
        self.app = app
        self.tenancy = tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            principal = self.tenancy.caller(scope["path"], scope["method"],
                                            presented_key(scope["headers"]))
        except APIError as error:  # before the body is read: nothing else is learnt
            await error.response()(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        if (record := current_record()) is not None:  # the request's log line names the key's id
            record.key_id = principal.key_id
        current = RequestTenancy(self.tenancy, principal)
        token = _CURRENT.set(current)

        async def send_releasing(message: Message) -> None:
            # the leases go before the response's last bytes do: a client that has read the
            # whole answer (a stream's [DONE] included) finds its slot free for the next request
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                current.release()
            await send(message)

        try:
            await self.app(scope, receive, send_releasing)
        finally:
            _CURRENT.reset(token)
            current.release()


def detach_leases() -> list[Lease]:
    """Take the current HTTP request's leases over: work that outlives the request (a Tinker
    future) releases them itself when it ends, instead of the request's end doing it."""
    current = _CURRENT.get()
    if current is None:
        return []
    leases, current.leases = current.leases, []
    return leases


def principal_of(request: Request) -> Principal:
    """The principal of a request, as AuthMiddleware decided it (OPEN there only for a server
    without keys). A request that reached a route without one is refused (401), never taken
    for the admin: the principal is decided once, at the edge, and passed down."""
    principal = getattr(request.state, "principal", None)
    if principal is None:
        raise unauthorized()
    return principal


# -- visibility ----------------------------------------------------------------------------------

def hidden(requested: str) -> APIError:
    """The 404 for another tenant's adapter, `requested` the name as the request gave it: the
    very error a name that names nothing gets (names.not_found)."""
    return not_found(requested)


def split_ref(model: str) -> tuple[str, str] | None:
    """(adapter id, tenant) of a model reference; None when it is not a valid one."""
    try:
        adapter_id, _ = parse_model_ref(model)
    except InvalidAdapterId:
        return None
    return adapter_id, adapter_id.split("/", 1)[0]


def split_id(adapter_id: str) -> tuple[str, str] | None:
    """(adapter id, tenant) of a plain adapter id (no `@rev`: what the adapter routes take);
    None when it is not a valid one."""
    try:
        validate_adapter_id(adapter_id)
    except InvalidAdapterId:
        return None
    return adapter_id, adapter_id.split("/", 1)[0]


def check_visible(principal: Principal, model: str, base: str | None = None,
                  requested: str | None = None) -> None:
    """Raise `hidden(requested)` when `model` (a model reference, not the base) names an adapter
    of a tenant the key may not see; anything else (the base, an invalid id) is left to the
    caller to answer. `requested`: the name the request gave (default `model`), when `model` is
    what an alias or tinker:// name resolved to."""
    ref = None if model == base else split_ref(model)
    if ref is not None and not principal.sees(ref[1]):
        raise hidden(model if requested is None else requested)


def check_visible_id(principal: Principal, adapter_id: str) -> None:
    """`check_visible` for a route that takes a plain adapter id: one with `@rev` is invalid
    there (the route's 400), whichever tenant it names."""
    ref = split_id(adapter_id)
    if ref is not None and not principal.sees(ref[1]):
        raise hidden(adapter_id)


def visible_ids(principal: Principal, ids: Sequence[str], base: str) -> list[str]:
    """The base and the ids in `ids` of tenants the key may see."""
    return [m for m in ids if m == base or (r := split_ref(m)) is None or principal.sees(r[1])]


def scoped_prefixes(principal: Principal, prefix: str) -> list[str]:
    """Catalog prefixes that cover exactly the ids under `prefix` in the key's tenants."""
    if principal.admin or ALL_TENANTS in principal.tenants:
        return [prefix]
    out = []
    for tenant in sorted(set(principal.tenants)):
        own = tenant + "/"
        if own.startswith(prefix):
            out.append(own)
        elif prefix.startswith(own):
            out.append(prefix)
    return out


def scoped_listing(request: Request,
                   lister: Callable[..., list[dict]]) -> Callable[..., list[dict]]:
    """`lister(view, prefix, limit, after, root)` (a catalog page of model cards) restricted to
    the caller's tenants: one page per tenant prefix, merged in id order."""
    principal = principal_of(request)

    def listing(view: Any, prefix: str, limit: int, after: str | None, root: str) -> list[dict]:
        pages = [lister(view, p, limit, after, root) for p in scoped_prefixes(principal, prefix)]
        return sorted((c for page in pages for c in page), key=lambda c: c["id"])[:limit]

    return listing


# -- generation admission ------------------------------------------------------------------------

@dataclass(slots=True)
class Admission:
    """An admitted generation request: its tenant, weight, the counters it feeds and the lease
    whose `used` tokens it counts (prompt tokens once prefilled, tokens as generated)."""

    tenant: str
    weight: float = 1.0
    counters: TenantCounters | None = None
    prompt_tokens: int = 0
    started: bool = False
    lease: Lease | None = None

    def engine(self, engine: Any) -> Any:
        """`engine` as this request's fan-out sees it (`TenantEngine`)."""
        return engine if self.counters is None else TenantEngine(engine, self)

    def prefilled(self, tokens: int) -> None:
        """One of its sequences has its prompt computed (its first delta came)."""
        if self.lease is not None and self.lease.used is not None:
            self.lease.used += tokens

    def count(self, out: RequestOutput) -> None:
        assert self.counters is not None
        if not self.started:  # the first delta: the request is running, not refused
            self.started = True
            self.counters.started(self.tenant, self.prompt_tokens)
        generated = len(out.token_ids)
        self.counters.generated(self.tenant, generated)
        if self.lease is not None and self.lease.used is not None:
            self.lease.used += generated


class TenantEngine:
    """An engine whose requests are one admission's and whose output tokens are counted for
    its tenant. A request carries the admission's facts from its construction (`fan_out`): the
    tenant is the directory's (`ResolvedModel.tenant`, which the request and the admission both
    read) and the fair-share weight the admission's. Neither is written here: a request of
    another tenant or weight is a bug, refused."""

    def __init__(self, engine: Any, admission: Admission):
        self.engine = engine
        self.admission = admission

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        carried = (request.tenant, request.tenant_weight)
        admitted = (self.admission.tenant, self.admission.weight)
        if carried != admitted:
            raise EngineError(f"request {request.request_id} carries (tenant, weight) {carried!r}, "
                              f"admitted as {admitted!r}", status=500, code="internal_error")
        return self._counted(request)

    async def _counted(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        it = self.engine.generate(request)
        if inspect.isawaitable(it):
            it = await it
        first = True
        try:
            async for out in it:
                if first:
                    first = False
                    self.admission.prefilled(len(request.prompt_token_ids))
                self.admission.count(out)
                yield out
        finally:  # closing this closes the engine's iterator (an abort when unfinished)
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


def admit(resolved: ResolvedModel, principal: Principal, prompts: Sequence[Any], n: int,
          max_tokens: int) -> Admission:
    """Admit one generation request that acts for `principal` (`prompts` have `token_ids`;
    `resolved` is its model as the `AdapterDirectory` decided it for that principal, so a model
    the key may not see never gets here: its 404 came first, exactly as a missing one's).

    429 over the tenant's limits (all its keys together) or the key's own, charging one
    request, n x (prompt + max_tokens) tokens per prompt and P x n sequences in flight, to the
    adapter's tenant (the key's home tenant for the base). The HTTP request's leases are held
    until it ends (`AuthMiddleware`); an app without it has no keys and so no limits to charge.
    """
    current = _CURRENT.get()
    if current is None:
        return Admission(resolved.tenant)
    tenant = resolved.tenant  # the directory's: the adapter's tenant, or the key's for the base
    tenancy = current.tenancy
    policy = tenancy.keys.tenant(tenant)
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    charge = n * (prompt_tokens + len(prompts) * max_tokens)
    try:
        lease = tenancy.limiter.admit(principal, tenant, len(prompts) * n, charge, policy.limits)
    except LimitExceeded as exc:
        tenancy.counters.rejected(tenant, exc.limit)
        raise
    lease.used = 0
    current.leases.append(lease)
    weight = principal.weight if policy.weight is None else policy.weight
    return Admission(tenant, weight, tenancy.counters, prompt_tokens, lease=lease)
