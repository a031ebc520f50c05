"""What the per-request id and log line cost: `RequestMiddleware` around a constant ASGI app.

    python bench/request_log.py [--requests 20000] [--rounds 5]

Each request is one ASGI call (scope, a constant 200 response) driven in-process, so only the
middleware's own work is timed. Targets, interleaved round by round (the box is shared: read
the ratios of one run, not the absolute figures):

  bare        the constant app alone
  quiet       RequestMiddleware with the access logger above INFO: the id, the header, the
              ContextVar and the record, no line written
  text        the line written, as `loraserve serve` writes it by default (TextFormatter) to
              /dev/null
  json        the same with --log-format json (JsonFormatter)
  uvicorn     the constant app and uvicorn's own access line (its AccessFormatter, as uvicorn
              writes it per request; `run_server` turns it off, the app's line replaces it)

Prints microseconds per request (median over rounds) and each target's cost over bare.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import logging
import statistics
import time

from uvicorn.logging import AccessFormatter

from loraserve.server.metrics import ServerMetrics
from loraserve.server.middleware import RequestMiddleware
from loraserve.server.request_log import (JsonFormatter, RequestIdFilter, TextFormatter,
                                          access_log)

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions",
         "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"bench-1")]}
BODY = b'{"id": "cmpl-1"}'
UVICORN_ACCESS = logging.getLogger("uvicorn.access")


async def constant(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})


async def _receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: dict) -> None:
    return None


async def uvicorn_line(scope, receive, send) -> None:
    """The constant app, then the access line uvicorn's httptools protocol writes."""
    await constant(scope, receive, send)
    UVICORN_ACCESS.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", scope["method"],
                        scope["path"], "1.1", 200)


async def _run(app, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        await app(dict(SCOPE), _receive, _send)
    return (time.perf_counter() - start) / n * 1e6


def _uvicorn_logging() -> None:
    handler = logging.StreamHandler(open("/dev/null", "w"))
    handler.setFormatter(AccessFormatter('%(levelprefix)s %(client_addr)s - "%(request_line)s" '
                                         '%(status_code)s'))
    UVICORN_ACCESS.handlers[:] = [handler]
    UVICORN_ACCESS.propagate = False
    UVICORN_ACCESS.setLevel(logging.INFO)


def _logging(kind: str) -> None:
    """The access logger as the target wants it: off (quiet) or to /dev/null in a format."""
    access_log.handlers.clear()
    access_log.propagate = False
    if kind == "quiet":
        access_log.setLevel(logging.WARNING)
        return
    handler = logging.StreamHandler(open("/dev/null", "w"))
    handler.setFormatter(JsonFormatter() if kind == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    wrapped = RequestMiddleware(constant, ServerMetrics())
    _uvicorn_logging()
    targets = {"bare": (constant, "quiet"), "quiet": (wrapped, "quiet"),
               "text": (wrapped, "text"), "json": (wrapped, "json"),
               "uvicorn": (uvicorn_line, "quiet")}
    times: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(args.rounds):
        for name, (app, kind) in targets.items():
            _logging(kind)
            times[name].append(asyncio.run(_run(app, args.requests)))
    bare = statistics.median(times["bare"])
    print(f"{'target':<8} {'us/request':>11} {'over bare':>10}")
    for name, values in times.items():
        us = statistics.median(values)
        print(f"{name:<8} {us:>11.2f} {us - bare:>10.2f}")


if __name__ == "__main__":
    main()
