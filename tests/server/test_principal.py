"""The principal of a request is decided once, by AuthMiddleware, and passed down: a request that
reaches a route without one (an app or a route mounted without the middleware) is refused, never
taken for the admin principal (issue 44)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from loraserve.keys import OPEN, Principal
from loraserve.server.errors import APIError
from loraserve.server.tenancy import principal_of


def _app(set_principal: Principal | None) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def decide(request: Request, call_next):
        if set_principal is not None:
            request.state.principal = set_principal
        return await call_next(request)

    @app.exception_handler(APIError)
    async def refused(request: Request, exc: APIError):
        return exc.response()

    @app.get("/who")
    async def who(request: Request) -> dict:
        p = principal_of(request)
        return {"key": p.key_id, "admin": p.admin}

    return app


def test_a_request_without_a_principal_is_refused_not_admin() -> None:
    r = TestClient(_app(None)).get("/who")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_the_principal_the_edge_decided_is_the_one_routes_read() -> None:
    user = Principal(key_id="k1", admin=False, tenants=("acme",))
    assert TestClient(_app(user)).get("/who").json() == {"key": "k1", "admin": False}
    assert TestClient(_app(OPEN)).get("/who").json() == {"key": None, "admin": True}


def test_the_tenant_is_the_directorys_and_the_engine_wrapper_never_rewrites_it() -> None:
    """The directory decides a request's tenant once (an adapter's tenant; for the base, the
    asking key's home tenant); the request carries it, admission charges it, and TenantEngine,
    which adds the admission's weight, refuses a request of another tenant instead of
    overwriting it."""
    import pytest

    from loraserve.engine.directory import AdapterDirectory
    from loraserve.engine.types import EngineError, GenerateRequest, SamplingParams
    from loraserve.server.tenancy import Admission, TenantEngine

    user = Principal(key_id="k1", admin=False, tenants=("acme",))
    base = AdapterDirectory("base").resolve("base", user)
    assert base.is_base and base.tenant == "acme"
    req = GenerateRequest("r", [1], SamplingParams(max_tokens=1), resolved=base)
    assert req.tenant == "acme"

    class Engine:
        async def generate(self, request):
            yield request

    admitted = Admission("acme", weight=3.0, counters=object())
    TenantEngine(Engine(), admitted).generate(req)
    assert req.tenant == "acme" and req.tenant_weight == 3.0
    other = GenerateRequest("o", [1], SamplingParams(max_tokens=1), tenant="globex")
    with pytest.raises(EngineError) as err:
        TenantEngine(Engine(), admitted).generate(other)
    assert err.value.status == 500 and other.tenant == "globex"
