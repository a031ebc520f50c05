"""One log line per request, and the request's id: what an OpenAI server's operators expect.

Each HTTP request gets an id: the client's `X-Request-Id` when it sends a usable one (printable
ASCII, at most REQUEST_ID_MAX characters), else a new one. The response echoes it in
`X-Request-Id`, and every line logged about the request names it. When the response has ended
(the last byte of a stream included), one INFO line goes to the `loraserve.server.access`
logger:

    {"request_id": "...", "method": "POST", "path": "/v1/chat/completions", "status": 200,
     "tenant": "acme", "model": "acme/support", "adapter": "acme/support@r3", "tier": "cpu",
     "prompt_tokens": 12, "completion_tokens": 40, "ttft_s": 0.031, "total_s": 0.412,
     "response_id": "chatcmpl-...", "key_id": "acme-prod"}

`key_id` is the id of the request's key in the keys file (a JWT the Tinker SDK traded a key for
names that key's id; never the key itself; null without keys or for a refused key);
`adapter` is the revision the request ran (`adapter@revision`, or the base's name); `tier` is
where that revision was when the request reached the engine (`AdapterManager.tier_of`, carried
on the first output): `device` (already in the pool), `cpu` (the CPU cache) or `catalog` (read
from disk), null for the base; `response_id` is the answer's `id`, which the engine's own lines
about the request (a failure naming it) use. Fields a request never reached stay null (a 401 has no tenant, a 400 no tokens). With `serve --log-format json` every
log line is one JSON object (`JsonFormatter`), the request line's fields at its top level;
otherwise the request line reads `request id=... status=... ...`.

The record is filled by whoever learns a fact (the endpoint: tenant, revision, tokens, times);
it lives in a ContextVar the middleware sets, so the handler reaches it without plumbing and
work outside a request (a test calling the endpoint directly) finds none and records nothing.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any

from loraserve.logs import JsonFormatter  # noqa: F401  (the server's formatter, every process's)
from loraserve.textsafe import encodable  # noqa: F401  (re-exported: the server's users import it here)

access_log = logging.getLogger("loraserve.server.access")

REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_MAX = 128
LOG_FORMATS = ("text", "json")


@dataclass(slots=True)
class RequestRecord:
    """What the request's log line says (module doc); times in seconds."""

    request_id: str
    method: str = ""
    path: str = ""
    status: int | None = None
    tenant: str | None = None
    model: str | None = None
    adapter: str | None = None
    tier: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    response_id: str | None = None  # the answer's `id` (cmpl-..., chatcmpl-...), the engine's
    key_id: str | None = None  # the id of the key the request came with (never the key)
    start: float = field(default_factory=time.perf_counter, repr=False)

    def line(self) -> dict[str, Any]:
        """The line's fields, in order, times rounded to the microsecond. (Read one by one:
        dataclasses.asdict deep-copies, and was most of the middleware's cost:
        bench/request_log.py.)"""
        out = {name: getattr(self, name) for name in _LINE_FIELDS}
        for name in ("ttft_s", "total_s"):
            if out[name] is not None:
                out[name] = round(out[name], 6)
        return out

    def since_start(self) -> float:
        return time.perf_counter() - self.start


_LINE_FIELDS = tuple(f.name for f in fields(RequestRecord) if f.name != "start")
_CURRENT: ContextVar[RequestRecord | None] = ContextVar("loraserve_request_record", default=None)


def current_record() -> RequestRecord | None:
    """The record of the HTTP request this code runs for (None outside one)."""
    return _CURRENT.get()


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when usable (printable ASCII, 1..REQUEST_ID_MAX characters),
    else a new one: an id that could break a log line or a header is never echoed."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            if 0 < len(value) <= REQUEST_ID_MAX and all(0x21 <= c < 0x7F for c in value):
                return value.decode("ascii")
            break
    return uuid.uuid4().hex


def begin(record: RequestRecord) -> object:
    """Make `record` the current request's; returns the token `end` takes."""
    return _CURRENT.set(record)


def end(token: object) -> None:
    _CURRENT.reset(token)  # type: ignore[arg-type]


def write(record: RequestRecord) -> None:
    """Log the request's one line (module doc); nothing to build when the logger is off."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    line = record.line()
    text = " ".join(f"{k}={_field(v)}" for k, v in line.items() if v is not None and k != "request_id")
    access_log.info("request id=%s %s", record.request_id, text, extra={"request": line})


def _field(value: Any) -> Any:
    """A value as the text line shows it: as it is when it cannot be mistaken for more of the
    line, else JSON-quoted. The model and path come from the client, and a space, `=`, a newline
    or a lone surrogate in them would forge fields, forge a line, or fail the log's encoder."""
    if not isinstance(value, str) or (value.isprintable() and " " not in value and "=" not in value):
        return value
    return json.dumps(value)  # ensure_ascii: control characters and surrogates escaped


class RequestIdFilter(logging.Filter):
    """Stamps each log record with the id of the HTTP request it was logged for (`request_id`,
    "" outside one), so every line about a request names it, whichever logger wrote it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            current = _CURRENT.get()
            record.request_id = current.request_id if current is not None else ""
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, with `[request <id>]` before the message inside a request."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return encodable(super().format(record))

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        rid = getattr(record, "request_id", "")
        if rid and record.name != access_log.name:  # the request line names it itself
            head, sep, message = text.partition(": ")
            text = f"{head}{sep}[request {rid}] {message}"
        return text


def configure_logging(level: str, fmt: str = "text") -> None:
    """The root logger at `level`, its lines as `fmt` ("text" or "json"), each stamped with its
    request's id. (uvicorn's loggers keep their own handlers unless uvicorn is told to leave
    logging alone, as `run_server` does for json.)"""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
