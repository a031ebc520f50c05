"""OpenAI-style error bodies and the mapping from every failure to one of them.

Every error the server answers with has the body
`{"error": {"message", "type", "param", "code"}}` and a status from DESIGN.md: 400 bad request,
401 missing/bad key, 404 unknown model/adapter, 409 base mismatch, 413 too large, 429/503 overload,
500 only for a bug.
"""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from loraserve.catalog.errors import CatalogError

from loraserve.engine.types import EngineError

logger = logging.getLogger("loraserve.server")

# Default `code` per status when the raiser gives none.
_STATUS_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "model_not_found",
                 405: "method_not_allowed", 409: "base_mismatch", 413: "request_too_large",
                 429: "overloaded", 500: "internal_error", 503: "overloaded"}


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class APIError(Exception):
    """An error answered as an OpenAI error body with HTTP `status`."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or _STATUS_CODES.get(status, "error")
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def as_api_error(exc: BaseException) -> APIError:
    """The APIError a failure is answered with.

    EngineError and CatalogError carry the HTTP status to answer with (catalog: 404 unknown
    adapter, 409 base mismatch, 400 invalid id, 500 corrupt). Anything else is a bug: logged,
    answered 500 without its details.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return APIError(exc.status, str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, CatalogError):
        return APIError(exc.status, str(exc), code=_catalog_code(exc, exc.status),
                        param="model" if exc.status < 500 else None)
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error")


def _catalog_code(exc: BaseException, status: int) -> str:
    """A snake_case code from a catalog error class (AdapterNotFound -> adapter_not_found)."""
    name = type(exc).__name__
    snake = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return snake if snake and snake != "catalog_error" else _STATUS_CODES.get(status, "error")


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as a 400 naming the offending field in `param`."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return APIError(400, f"Malformed JSON body: {reason}",
                        code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type name to the location (prompt.list[int].0); drop those.
    loc = [p for p in loc if not (p.endswith("]") and "[" in p) and p not in ("str", "int")]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        msg = "the request body must be a JSON object"
    elif first.get("type") == "missing":
        msg = "field required"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


async def _handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    return as_api_error(exc).response()


async def _handle_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc).response()


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return APIError(exc.status_code, str(exc.detail)).response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure on `app` with an OpenAI error body."""
    app.add_exception_handler(APIError, _handle_api_error)
    app.add_exception_handler(EngineError, _handle_api_error)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(Exception, _handle_api_error)


def sse_error(exc: BaseException) -> str:
    """An error raised mid-stream, as one SSE event the openai client turns into an APIError."""
    return f"data: {json.dumps(as_api_error(exc).body())}\n\n"
