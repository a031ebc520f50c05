"""A blob that fails its checksum here, healed from the durable tier (`--catalog-store`).

The catalog verifies every blob it reads (size and xxh3-128 against the revision record); one
that fails is CorruptBlob, and without a store that stays the revision's answer (500
`corrupt_blob`, never served). With a store, the pager asks `BlobHealer.heal(record)` first: the
store's copy of that revision is located (its policy document: a segment or `blobs/`), read,
verified against the *local* record (same size, same checksum: the store's bytes must be the
ones this revision names), written over the bad blob in one write transaction, and served. Each
heal is a WARNING log line naming the revision; `healed` and `unhealed` count them. A store that
is down, lacks the revision or holds other bytes leaves the CorruptBlob as it was.
"""
from __future__ import annotations

import logging
import threading

from .errors import CorruptBlob
from .records import RevisionRecord

log = logging.getLogger(__name__)


class BlobHealer:
    """Heals corrupt blobs of `catalog` from `store` (an `ObjectStore`). Any thread may call it."""

    def __init__(self, catalog, store) -> None:
        self.catalog, self.store = catalog, store
        self.healed = 0
        self.unhealed = 0
        self._lock = threading.Lock()

    def heal(self, record: RevisionRecord, error: CorruptBlob) -> bytearray:
        """`record`'s verified bytes from the store, rewritten here; `error` (the local read's)
        raised again when the store cannot give them."""
        try:
            doc = self.store.policy_doc(record.adapter_id)
            found, where = self.store.locate(doc, record.revision)
            if found is None or (found.checksum, found.size) != (record.checksum, record.size):
                raise CorruptBlob(f"{record.ref}: the store holds no copy of these bytes")
            blob = self.store.blob(found, where)  # verified against the store's record, the same
            self.catalog.rewrite_blob(record, blob)
        except Exception as exc:  # noqa: BLE001 - a store that is down or lacks it: as before
            with self._lock:
                self.unhealed += 1
            log.warning("%s fails its checksum here and could not be healed from the store (%s)",
                        record.ref, exc)
            raise error from None
        with self._lock:
            self.healed += 1
        log.warning("%s failed its checksum here (%s); re-fetched from the store, verified, "
                    "rewritten and served", record.ref, error)
        return bytearray(blob)
