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
