"""`catalog materialize --store s3://bucket/prefix`: each worker publishes what it builds, as it goes.

A materialize worker (catalog.materialize_worker, its own process) commits a batch of adapters
to its shard in one LMDB transaction, then hands the batch to its `BatchPublisher`: the batch's
blobs go up as one segment object and each adapter gets one policy object (store_bulk
`put_segment`), the policy PUTs on the publisher's threads. Each policy is a conditional PUT
that only creates (If-None-Match: *), so an adapter the store already holds (another writer's,
or one published before a crash) is left as the store has it and counted `already`.

Resumable: after each published batch the worker records the batch's last id for that shard
in `DIR/store-published/shard-NNN.json` (with the store's URI). A shard's ids are built in id
order, so on a rerun every adapter of the shard up to that id is in the store. Those after it
that the catalog already holds were committed but perhaps not published (a kill between the
two). The worker publishes them first (`catch_up`), read back from the shard, and only then
builds the rest.

`store_only` (`--store-only`) keeps the local catalog out of it, for a namespace larger than one
host's disk: a worker builds each batch in memory and publishes it, and nothing is written to
LMDB, so the run's local footprint is the markers alone (the store is the copy; hosts fault in).
The marker is then the only resume point: a rerun skips each shard's ids up to it and builds the
rest again. Building is deterministic (an adapter's blob is a function of its id and the seed),
and the policies are conditional creates, so a batch published before a kill but not yet marked
is built again and found `already` (its second segment is unreferenced: `catalog store-gc`'s).
A build error stops that shard before its marker passes the batch, so the rerun retries it.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .records import PolicyRecord, RevisionRecord
from .shards import Shard
from .store import _blob_bytes
from .store_bulk import put_segment
from .store_objects import ObjectStore
from .writes import read_policy, read_revision

MARKERS = "store-published"


def read_adapters_in_txn(txn, dbs, adapter_ids: list[str]) -> list[tuple[PolicyRecord, list[tuple[RevisionRecord, bytes]]]]:
    """(policy, [(record, blob)]) of each of `adapter_ids` the shard holds, blobs verified."""
    out = []
    for adapter_id in adapter_ids:
        policy = read_policy(txn, dbs, adapter_id)
        if policy is not None:
            records = [read_revision(txn, dbs, adapter_id, rev) for rev in policy.revisions]
            out.append((policy, [(r, _blob_bytes(txn, dbs, r)) for r in records]))
    return out


class BatchPublisher:
    """One materialize worker's publishing into the store (module doc)."""

    def __init__(self, uri: str, catalog_dir: Path, threads: int = 8) -> None:
        self.store = ObjectStore(uri, max_pool=threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="loraserve-materialize-publish")
        self.markers = Path(catalog_dir) / MARKERS
        self.markers.mkdir(exist_ok=True)
        self.published = 0  # policies written
        self.already = 0  # adapters the store held already

    def marker(self, shard: int) -> str | None:
        """The last id of `shard` published into this store, or None."""
        try:
            saved = json.loads((self.markers / f"shard-{shard:03d}.json").read_text())
        except (OSError, ValueError):
            return None
        return saved.get("last") if saved.get("store") == self.store.uri else None

    def _mark(self, shard: int, last: str) -> None:
        path = self.markers / f"shard-{shard:03d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"store": self.store.uri, "last": last}))
        tmp.replace(path)

    def publish(self, shard: int, adapters: list[tuple[PolicyRecord, list[tuple[RevisionRecord, bytes]]]]) -> None:
        """One committed batch of `shard` (in id order) into the store, then the shard's marker."""
        if not adapters:
            return
        written = put_segment(self.store, adapters, new_only=True, pool=self.pool)
        self.published += written
        self.already += len(adapters) - written
        self._mark(shard, adapters[-1][0].adapter_id)

    def catch_up(self, shard: Shard, held: list[str], batch: int) -> None:
        """Publish the adapters of `held` (the shard's ids it holds, in order) after its marker."""
        last = self.marker(shard.index)
        pending = [a for a in held if last is None or a > last]
        for lo in range(0, len(pending), batch):
            ids = pending[lo:lo + batch]
            self.publish(shard.index, shard.read(lambda txn, dbs: read_adapters_in_txn(txn, dbs, ids), default=[]))

    def build_shard(self, shard: int, ids: list[str], batch_size: int, build, progress
                    ) -> tuple[int, int, list[str]]:
        """`store_only`: build the ids of `shard` after its marker, `batch_size` at a time, and
        publish each batch (module doc); (built, skipped, errors) like the local build.
        `build(ids)` makes a batch's adapters (the materialize worker's builder: passed in, so
        this module never imports the worker, which imports it)."""
        last = self.marker(shard)
        todo = [a for a in ids if last is None or a > last]
        with progress.get_lock():
            progress.value += len(ids) - len(todo)
        for lo in range(0, len(todo), batch_size):
            batch = todo[lo:lo + batch_size]
            try:
                made = build(batch)
            except Exception as e:  # counted and reported; the marker stays before this batch
                return lo, len(ids) - len(todo), [f"batch {batch[:1]}..: {e}"]
            self.publish(shard, made)
            with progress.get_lock():
                progress.value += len(batch)
        return len(todo), len(ids) - len(todo), []

    def close(self) -> None:
        self.pool.shutdown()
