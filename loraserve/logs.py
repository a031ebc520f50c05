"""Log lines as `serve --log-format` asks, in every process of a server: one JSON object a line.

The API server sets the root logger (`server.request_log.configure_logging`); the processes it
starts (the engine core, catalog shard hosts) inherit `LORASERVE_LOG_FORMAT` and set theirs with
`configure_process_logging`, so their lines are the same JSON objects, with the process's name.

Some writers are no logger: a C extension printing at interpreter exit (triton's nanobind leak
report), a library's bare print, a traceback Python writes as a process dies. With json,
`ship_stdio_as_json` sends this process's stdout and stderr, which every child inherits, through
a small process of their own that passes JSON object lines on and wraps any other line as one
(`{"time", "level", "logger": "stdout"|"stderr", "message"}`). It reads until every writer has
closed the streams, so the last line a process writes as it exits is wrapped too.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any

from loraserve.textsafe import encodable

LOG_FORMAT_ENV = "LORASERVE_LOG_FORMAT"


class JsonFormatter(logging.Formatter):
    """Each record as one JSON object: time, level, logger, message, and a request line's fields
    at the top level (`extra={"request": {...}}`); an exception's traceback under `exc_info`;
    the process's name where it is not the main one (the engine core's lines say `core`)."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.process is not None:
            line["process"] = self.process
        if getattr(record, "request_id", ""):
            line["request_id"] = record.request_id
        request = getattr(record, "request", None)
        if isinstance(request, dict):
            line.update(request)
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return encodable(json.dumps(line, ensure_ascii=False, default=str))


def json_wanted() -> bool:
    """Whether this process's server asked for JSON lines (`serve --log-format json`)."""
    return os.environ.get(LOG_FORMAT_ENV) == "json"


def configure_process_logging(process: str, level: int, text_format: str) -> None:
    """A child process's root logger at `level`: JSON lines naming `process` when its server
    logs JSON, else `text_format` lines (logging.basicConfig: a logger already set stays)."""
    if not json_wanted():
        logging.basicConfig(level=level, format=text_format)
        return
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter(process))
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)


# The shipper: stdin is unused; fds argv[1], argv[2] are the read ends of this process's stdout
# and stderr pipes; it writes to the streams the server had (its own stdout and stderr). It
# ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group) and ends at EOF.
_SHIPPER = r"""
import json, os, selectors, signal, sys
from datetime import datetime, timezone
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
outs = {int(sys.argv[1]): ("stdout", "INFO", sys.stdout.fileno()),
        int(sys.argv[2]): ("stderr", "WARNING", sys.stderr.fileno())}
pending = {fd: b"" for fd in outs}

def ship(fd, raw):
    name, level, out = outs[fd]
    text = raw.decode("utf-8", "backslashreplace").rstrip("\r")
    if not text.strip():
        return
    try:
        is_object = isinstance(json.loads(text), dict)
    except ValueError:
        is_object = False
    if not is_object:
        text = json.dumps({"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                           "level": level, "logger": name, "message": text}, ensure_ascii=False)
    data = (text + "\n").encode("utf-8", "backslashreplace")
    while data:
        data = data[os.write(out, data):]

sel = selectors.DefaultSelector()
for fd in outs:
    sel.register(fd, selectors.EVENT_READ)
while outs.keys() & pending.keys():
    for key, _ in sel.select():
        fd = key.fd
        chunk = os.read(fd, 65536)
        if not chunk:
            sel.unregister(fd)
            if pending[fd]:
                ship(fd, pending[fd])
            del pending[fd]
            continue
        *lines, pending[fd] = (pending[fd] + chunk).split(b"\n")
        for line in lines:
            ship(fd, line)
"""


def ship_stdio_as_json() -> subprocess.Popen:
    """Send this process's stdout and stderr (fds 1 and 2, and so every child's) through the
    shipper process (module doc); returns it. Python's own streams are flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    shipper = subprocess.Popen([sys.executable, "-S", "-c", _SHIPPER, str(out_r), str(err_r)],
                               stdin=subprocess.DEVNULL, pass_fds=(out_r, err_r), close_fds=True)
    os.close(out_r)
    os.close(err_r)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)
    return shipper
