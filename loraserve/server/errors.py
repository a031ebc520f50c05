"""OpenAI-style error bodies and the mapping from every failure to one of them.

Every error the server answers with has the body
`{"error": {"message", "type", "param", "code"}}` and a status from DESIGN.md: 400 bad request,
401 missing/bad key, 404 unknown model/adapter/route, 405 wrong method (with `Allow`), 409 base
mismatch, 413 too large, 429/503 overload (429 with `Retry-After`), 500 only for a bug.

Values a client sent are echoed at most `ECHO_MAX` characters long (`clip`), and every message and
param is made encodable (a lone surrogate becomes U+FFFD), so rendering an error never fails.
The app's OpenAPI document lists these error responses, not FastAPI's 422 (`install_openapi`).
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from loraserve.catalog.errors import CatalogError

from loraserve.engine.types import EngineError

logger = logging.getLogger("loraserve.server")

# Default `code` per status when the raiser gives none.
_STATUS_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
                 405: "method_not_allowed", 409: "base_mismatch", 413: "request_too_large",
                 429: "rate_limit_exceeded", 500: "internal_error", 503: "overloaded"}

ECHO_MAX = 256        # characters of a client's value echoed in a message
MESSAGE_MAX = 1024    # characters of a message (a catalog/engine message may quote a long id)
RETRY_AFTER_S = 1     # what a 429 tells the client to wait, in seconds


def clip(value: object, limit: int = ECHO_MAX) -> str:
    """`value` as text cut to `limit` characters (an ellipsis marks the cut)."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD, so that it always encodes as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


_LONG_WORD = re.compile(r"\S{%d,}" % (ECHO_MAX + 1))


def _clip_words(text: str) -> str:
    """Every run of non-space characters cut to ECHO_MAX: an echoed value (an id a catalog or
    engine message quotes) is clipped where it stands, and the rest of the message is kept."""
    return _LONG_WORD.sub(lambda m: clip(m.group(0)), text) if len(text) > ECHO_MAX else text


def _clip_middle(text: str, limit: int) -> str:
    """Keep the head and the tail (a reason usually ends a message) of an over-long text."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return text[:head] + "\u2026" + text[len(text) - (limit - head - 1):]


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
                 param: str | None = None, headers: dict[str, str] | None = None):
        message = _clip_middle(_clip_words(_encodable(message)), MESSAGE_MAX)
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or _STATUS_CODES.get(status, "error")
        self.param = None if param is None else clip(_encodable(param))
        self.headers = dict(headers or {})
        if status == 429:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


class BodyError(StarletteHTTPException):
    """An APIError raised while FastAPI reads or parses a request body.

    FastAPI turns any other exception raised there into a bare 400; an HTTPException it re-raises,
    so this one reaches the handlers with its own status, code and param.
    """

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message)
        self.error = error


def as_api_error(exc: BaseException) -> APIError:
    """The APIError a failure is answered with.

    EngineError and CatalogError carry the HTTP status to answer with (catalog: 404 unknown
    adapter, 409 base mismatch, 400 invalid id, 500 corrupt blob, 503 `catalog_unavailable` for
    a shard that cannot be read or a write the OS refused, naming the shard: the catalog raises
    ShardUnavailable for those, never a bare CatalogError or an LMDB error, which would be a 500
    here). Anything else is a bug: logged, answered 500 without its details.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return APIError(exc.status, str(exc), code=exc.code, param=exc.param)
    if isinstance(exc, CatalogError):  # its class's `code`, else one from the class name
        code = getattr(exc, "code", None) or _catalog_code(exc, exc.status)
        return APIError(exc.status, str(exc), code=code,
                        param="model" if exc.status < 500 else None)
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error")


def _catalog_code(exc: BaseException, status: int) -> str:
    """A snake_case code from a catalog error class (AdapterNotFound -> adapter_not_found)."""
    name = type(exc).__name__
    snake = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return snake if snake and snake != "catalog_error" else _STATUS_CODES.get(status, "error")


# validation error types (protocol.py's size checks) that are the error's `code`
_VALIDATION_CODES = ("context_length_exceeded", "too_many_sequences")


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
    code = first.get("type") if first.get("type") in _VALIDATION_CODES else None
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code=code)


async def _handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    return as_api_error(exc).response()


async def _handle_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc).response()


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyError):
        return exc.error.response()
    headers = dict(exc.headers or {})  # 405 carries `Allow`
    if exc.status_code == 404:
        message = f"No route {clip(request.method, 16)} {clip(request.url.path)}"
    elif exc.status_code == 405:
        message = (f"Method {clip(request.method, 16)} is not allowed on {clip(request.url.path)}"
                   + (f"; allowed: {headers['Allow']}" if "Allow" in headers else ""))
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=headers).response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure on `app` with an OpenAI error body; document them (install_openapi)."""
    app.add_exception_handler(APIError, _handle_api_error)
    app.add_exception_handler(EngineError, _handle_api_error)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(Exception, _handle_api_error)
    install_openapi(app)


# -- the OpenAPI document: the error responses the server really sends ---------------------------

_ERROR_SCHEMA = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "code": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}},
}
_ERROR_DESCRIPTIONS = {
    400: "Bad request: malformed JSON or an invalid field or parameter (`param` names it)",
    401: "Missing or unknown API key (when the server has keys)",
    403: "The key may not do this",
    404: "Unknown model, adapter, revision or route",
    409: "Conflict, e.g. an adapter exported against another base",
    413: "Request body over --max-request-bytes",
    429: "Too many requests queued; retry after `Retry-After` seconds",
    500: "A server bug (details are logged, not sent)",
    503: "Overloaded, not ready, or shutting down",
}


def _error_responses() -> dict[int, dict[str, Any]]:
    """The error responses any operation may answer with (a route declaring more keeps them)."""
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    responses = {}
    for status, description in _ERROR_DESCRIPTIONS.items():
        responses[status] = {"description": description,
                             "content": {"application/json": {"schema": ref}}}
    responses[429]["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                                 "schema": {"type": "integer"}}}
    return responses


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` describe the errors the server sends: the OpenAI error body under
    every status in _ERROR_DESCRIPTIONS, and no 422 (every validation failure is a 400)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path, item in schema.get("paths", {}).items():
            for method, op in item.items():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                op["responses"].pop("422", None)
                for status, response in _error_responses().items():
                    op["responses"].setdefault(str(status), response)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        schemas["ErrorResponse"] = _ERROR_SCHEMA
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def sse_error(exc: BaseException) -> str:
    """An error raised mid-stream, as one SSE event the openai client turns into an APIError."""
    return f"data: {json.dumps(as_api_error(exc).body())}\n\n"
