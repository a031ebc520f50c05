"""The durable tier's change log: written on each policy change, followed by every host's poll.

An entry is `log/<unix ns, 20 digits>-<host>-<n>.json` holding `{"adapter_id": ...}`: the keys
sort by time, the host part lets a host skip its own writes, and `n` orders one host's writes
within a nanosecond. A reader lists the keys after its cursor less `skew_s` (writers' clocks
agree within `skew_s`; an entry inside the window is applied once, remembered by key), and keeps
the cursor in `store-cursor.json` beside the shards, so a restarted host reads the changes it
missed while it was down (a cursor saved for another store is ignored).
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

from .lru import BoundedLRU
from .store_objects import ObjectStore

APPLIED_MAX = 65536  # log keys remembered as applied (those within the skew window)


class ChangeLog:
    """One host's writer and reader of the store's change log (module doc)."""

    def __init__(self, store: ObjectStore, cursor_file: Path, *, skew_s: float = 10.0) -> None:
        self.store, self.cursor_file, self.skew_s = store, cursor_file, skew_s
        self.host = uuid.uuid4().hex[:12]
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        self._cursor = ""  # the newest log key read
        self._saved = ""  # the cursor the file holds
        self._applied: BoundedLRU[str, bool] = BoundedLRU(APPLIED_MAX)

    def append(self, adapter_id: str) -> None:
        """Write one entry: `adapter_id`'s policy changed."""
        with self._sequence_lock:
            self._sequence += 1
            n = self._sequence
        name = f"{time.time_ns():020d}-{self.host}-{n:08d}.json"
        self.store.put(self.store.key("log", name), json.dumps({"adapter_id": adapter_id}).encode())

    def changed(self) -> list[str]:
        """The adapter ids other hosts changed since the last call, in log order (each entry once)."""
        ids = []
        for key in self.store.log_after(self._window_start()):
            if self._applied.get(key) is not None:
                continue
            self._applied.put(key, True)
            self._cursor = max(self._cursor, key)
            if f"-{self.host}-" in key.rpartition("/")[2]:
                continue  # this host's own write
            raw = self.store.get(key)
            adapter_id = json.loads(raw).get("adapter_id") if raw else None
            if adapter_id is not None:
                ids.append(adapter_id)
        return ids

    def _window_start(self) -> str:
        """The log key to list after: `skew_s` before the cursor (on the first poll: the saved
        cursor, else now)."""
        if not self._cursor:
            self._cursor = self._load_cursor() or self._log_key(time.time_ns())
        cursor_ns = int(self._cursor.rpartition("/")[2][:20])
        return self._log_key(max(0, cursor_ns - int(self.skew_s * 1e9)))

    def _log_key(self, ns: int) -> str:
        return self.store.key("log", f"{ns:020d}")

    def _load_cursor(self) -> str:
        try:
            saved = json.loads(self.cursor_file.read_text())
        except (OSError, ValueError):
            return ""
        return saved.get("cursor", "") if saved.get("store") == self.store.uri else ""  # another store's

    def save_cursor(self) -> None:
        """Kept beside the shards, so a restarted host reads the changes it missed while down."""
        if self._cursor == self._saved:
            return
        self._saved = self._cursor
        tmp = self.cursor_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"store": self.store.uri, "cursor": self._cursor}))
        tmp.replace(self.cursor_file)
