"""The control-plane audit log: one JSON line per action (load, unload, promote, rollback,
reload-keys), whatever its outcome.

    {"time": "2025-01-01T12:00:00.000+00:00", "key": "acme-ops", "action": "promote",
     "adapter": "acme/support", "revision": "r3", "outcome": "ok"}

`outcome` is "ok", "denied" (the key may not do it: 401/403, or a 404 for another tenant's id)
or "failed"; the last two add `status` and `error`. `key` is the key id (null on a server
without keys, or for a reload by SIGHUP). With a file, each line is appended and flushed
(the file is opened per line, so a rotated log is picked up); without one, lines go to the
`loraserve.audit` logger.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone
from pathlib import Path

from loraserve.server.request_log import encodable

log = logging.getLogger("loraserve.audit")

OK, DENIED, FAILED = "ok", "denied", "failed"


class AuditLog:
    """Appends audit lines to `path` (or logs them when None). Written from the event loop."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = None if path is None else Path(path)
        if self.path is not None:  # an unwritable log stops the server now, not at an action
            with open(self.path, "a", encoding="utf-8"):
                pass

    def record(self, *, key: str | None, action: str, adapter: str | None = None,
               revision: str | None = None, outcome: str = OK, status: int | None = None,
               error: str | None = None) -> dict:
        """Write one line; returns it as a dict."""
        line: dict = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                      "key": key, "action": action, "adapter": adapter, "revision": revision,
                      "outcome": outcome}
        if status is not None:
            line["status"] = status
        if error is not None:
            line["error"] = error
        text = encodable(json.dumps(line, ensure_ascii=False))  # an adapter id may hold a lone surrogate
        if self.path is None:
            log.info("%s", text)
        else:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
                f.flush()
        return line
