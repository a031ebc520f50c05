"""The durable tier's change log: written on each policy change, followed by every host's poll,
compacted into a snapshot so it stays small.

An entry is the key `log/<unix ns, 20 digits>-<host>-<n>-<quoted adapter id>` (the body is
empty: a poll reads names only, one listing for any number of entries). The keys sort by time,
the host part lets a host skip its own writes, and `n` orders one host's writes within a
nanosecond. A reader lists the keys after its cursor less `skew_s` (writers' clocks agree
within `skew_s`; an entry inside the window is applied once, remembered by key), and keeps the
cursor in `store-cursor.json` beside the shards, so a restarted host reads the changes it missed
while it was down (a cursor saved for another store is ignored).

Compaction (`compact`, `loraserve catalog compact-log`; one compactor per store at a time: the
command holds the store's maintenance lease, store_lease)
folds the entries older than `keep_s` into `log-snapshot.json` (`changed`: adapter id -> its
newest pruned key, only those newer than `horizon_s`; `since`: the key from which it is
complete; `upto`: the newest pruned key), writes the small `log-pruned.json` (`since`, `upto`),
and only then deletes the entries. The log is left with `keep_s` of entries and the snapshot
with one entry per adapter changed within `horizon_s`. A reader lists first and reads
`log-pruned.json` after (so an entry deleted before the listing reached it was pruned after
the marker was written: the reader sees the new marker): when entries after its window were
pruned, it takes their ids from the snapshot, or, when its window starts before the snapshot's
`since` (a host down longer than the horizon), reconciles every adapter it holds.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

from .lru import BoundedLRU
from .store_objects import ObjectStore

APPLIED_MAX = 65536  # log keys remembered as applied (those within the skew window)
SNAPSHOT, PRUNED = "log-snapshot.json", "log-pruned.json"


def entry_adapter(key: str) -> tuple[str, str]:
    """(host, adapter id) of a log entry's key."""
    _, host, _, quoted = key.rpartition("/")[2].split("-", 3)
    return host, unquote(quoted)


@dataclass(slots=True)
class Changes:
    """What a poll found: the adapter ids changed, or `everything` (reconcile all held)."""

    ids: list[str] = field(default_factory=list)
    everything: bool = False
    keys: list[str] = field(default_factory=list)  # the entries read (`ChangeLog.unread`)
    before: tuple[str, str] = ("", "")  # the reader's cursor and pruned mark before


class ChangeLog:
    """One host's writer and reader of the store's change log (module doc)."""

    def __init__(self, store: ObjectStore, cursor_file: Path, *, skew_s: float = 10.0) -> None:
        self.store, self.cursor_file, self.skew_s = store, cursor_file, skew_s
        self.host = uuid.uuid4().hex[:12]
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        self._cursor = ""  # the newest log key read
        self._saved = ""  # the cursor the file holds
        self._pruned = ""  # the newest `upto` of log-pruned.json taken into account
        self._applied: BoundedLRU[str, bool] = BoundedLRU(APPLIED_MAX)

    def append(self, adapter_id: str) -> None:
        """Write one entry: `adapter_id`'s policy changed."""
        with self._sequence_lock:
            self._sequence += 1
            n = self._sequence
        name = f"{time.time_ns():020d}-{self.host}-{n:08d}-{quote(adapter_id, safe='')}"
        self.store.put(self.store.key("log", name), b"")

    def changed(self) -> Changes:
        """What other hosts changed since the last call, in log order (each entry once)."""
        start = self._window_start()
        found = Changes(before=(self._cursor, self._pruned))
        for key in self.store.log_after(start):
            if self._applied.get(key) is not None:
                continue
            self._applied.put(key, True)
            found.keys.append(key)
            self._cursor = max(self._cursor, key)
            host, adapter_id = entry_adapter(key)
            if host != self.host:
                found.ids.append(adapter_id)
        self._read_pruned(start, found)
        return found

    def unread(self, found: Changes) -> None:
        """Applying `found` failed (the store went down midway): the next call reads it again."""
        for key in found.keys:
            self._applied.pop(key)
        self._cursor, self._pruned = found.before

    def _read_pruned(self, start: str, found: Changes) -> None:
        """Entries after `start` that compaction pruned: from the snapshot (module doc)."""
        pruned = self.store.get_json(self.store.key(PRUNED))
        if pruned is None or pruned["upto"] <= max(start, self._pruned):
            return
        snapshot = self.store.get_json(self.store.key(SNAPSHOT)) or {"since": pruned["upto"], "changed": {}}
        if start < snapshot["since"]:
            found.everything = True
        else:
            found.ids += [i for i, key in snapshot["changed"].items() if key > start]
        self._pruned = pruned["upto"]
        self._cursor = max(self._cursor, pruned["upto"])

    def _window_start(self) -> str:
        """The log key to list after: `skew_s` before the cursor (on the first poll: the saved
        cursor, else now)."""
        if not self._cursor:
            self._cursor = self._load_cursor() or log_key(self.store, time.time_ns())
        cursor_ns = int(self._cursor.rpartition("/")[2][:20])
        return log_key(self.store, max(0, cursor_ns - int(self.skew_s * 1e9)))

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


def log_key(store: ObjectStore, ns: int) -> str:
    return store.key("log", f"{ns:020d}")


def compact(store: ObjectStore, *, keep_s: float = 3600.0, horizon_s: float = 7 * 86400.0,
            now_ns: int | None = None, lease=None) -> int:
    """Fold the log entries older than `keep_s` into the snapshot and delete them (module doc);
    how many were pruned. `lease` (store_lease.StoreLease, held for the run) is checked before
    each write, so a compactor that lost it stops before it writes."""
    check = lease.check if lease is not None else lambda: None
    now_ns = time.time_ns() if now_ns is None else now_ns
    cutoff = log_key(store, now_ns - int(keep_s * 1e9))
    old = [k for k in store.log_after("") if k < cutoff]
    if not old:
        return 0
    snapshot = store.get_json(store.key(SNAPSHOT)) or {"since": "", "changed": {}}
    changed = snapshot["changed"]
    for key in old:
        adapter_id = entry_adapter(key)[1]
        changed[adapter_id] = max(changed.get(adapter_id, ""), key)
    horizon = log_key(store, now_ns - int(horizon_s * 1e9))
    since = max(snapshot["since"], horizon)
    upto = max(old)
    check()
    store.put_json(store.key(SNAPSHOT), {"since": since, "upto": upto,
                                         "changed": {i: k for i, k in changed.items() if k >= since}})
    store.put_json(store.key(PRUNED), {"since": since, "upto": upto})
    check()
    store.delete(old)
    return len(old)
