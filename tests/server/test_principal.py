"""The principal of a request is decided once, by AuthMiddleware, and passed down: a request that
reaches a route without one (an app or a route mounted without the middleware) is refused, never
taken for the admin principal (issue 44)."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from loraserve.engine.types import GenerateRequest
from loraserve.keys import OPEN, Principal
from loraserve.server.errors import APIError
from loraserve.server.tenancy import principal_of


async def _drain(stream) -> None:
    async for _ in stream:
        pass


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
    asking key's home tenant) and admission its weight; the requests are built carrying both
    (`fan_out`), and TenantEngine forwards them as they are: a request of another tenant or
    weight is refused, not overwritten."""
    import pytest

    from loraserve.engine.directory import AdapterDirectory
    from loraserve.engine.types import EngineError, SamplingParams
    from loraserve.server.serving import Prompt, fan_out
    from loraserve.server.tenancy import Admission, TenantEngine

    user = Principal(key_id="k1", admin=False, tenants=("acme",))
    base = AdapterDirectory("base").resolve("base", user)
    assert base.is_base and base.tenant == "acme"
    params = SamplingParams(max_tokens=1)
    [req] = fan_out("r", [Prompt("", [1])], 1, params, base, 3.0)
    assert (req.tenant, req.tenant_weight) == ("acme", 3.0)

    class Engine:
        seen: list = []

        async def generate(self, request):
            self.seen.append(request)
            return
            yield

    admitted = Admission("acme", weight=3.0, counters=object())
    asyncio.run(_drain(TenantEngine(Engine(), admitted).generate(req)))
    [seen] = Engine.seen  # the request itself, its fields as fan_out built them
    assert seen is req and (req.tenant, req.tenant_weight) == ("acme", 3.0)
    other_tenant = GenerateRequest("o", [1], params, tenant="globex", tenant_weight=3.0)
    other_weight = fan_out("w", [Prompt("", [1])], 1, params, base, 1.0)[0]
    for other in (other_tenant, other_weight):
        with pytest.raises(EngineError) as err:
            TenantEngine(Engine(), admitted).generate(other)
        assert err.value.status == 500
    assert (other_tenant.tenant, other_weight.tenant_weight) == ("globex", 1.0)
