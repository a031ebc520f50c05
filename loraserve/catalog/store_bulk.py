"""Publish a whole catalog into its durable tier: batched, parallel, resumable, with a progress bar.

`loraserve catalog publish DIR --store s3://bucket/prefix` is how a catalog built locally (by
`catalog materialize`, imports, an rsync'd copy) becomes the store's. Adapters are read a page
at a time in id order. One listing per page tells which adapters the store already has a
policy for: those go through the ordinary publish on `workers` threads (`StoreTier.published`:
one policy read, then only what differs). The others, new to the store, are split into
`workers` parts written at once, each in bulk: its blobs end to end as one segment object
(`segments/<uuid>`), then one policy object each whose `placed` gives every revision's record
and place in the segment (store_objects). So a new adapter costs one PUT and a share of a
segment, not five requests. The policy goes last: an adapter is in the store once its policy
is, and an interrupted run leaves at most an unreferenced segment. Publishing is idempotent,
so an interrupted run is resumed by running it again; `--after ID` starts past an id instead.
A new adapter needs no change-log entry (no host holds it yet).
"""
from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from .errors import CatalogError
from .records import PolicyRecord, RevisionRecord
from .store import Catalog
from .store_objects import ObjectStore, PolicyDoc, WriteConflict, policy_bytes
from .store_s3 import StoreTier

PAGE = 1000


@dataclass(slots=True)
class PublishReport:
    adapters: int = 0  # seen
    published: int = 0  # uploaded something
    last: str | None = None  # the last adapter id done (a resume point)


def publish_catalog(catalog: Catalog, tier: StoreTier, *, workers: int = 8, after: str | None = None,
                    progress: bool = True) -> PublishReport:
    """Publish every adapter of `catalog` (after id `after`) through `tier` (module doc). A
    store error names the resume point (`--after`)."""
    report = PublishReport(last=after)
    total = catalog.stats()["adapters"] if progress else None
    with ThreadPoolExecutor(workers, thread_name_prefix="loraserve-publish") as pool, \
            tqdm(total=total, unit="adapter", disable=not progress, desc="publish") as bar:
        while page := catalog.list(limit=PAGE, after=report.last):
            try:
                report.published += publish_page(catalog, tier, page, pool, workers)
            except CatalogError as exc:
                raise type(exc)(f"{exc}; every adapter up to {report.last} is published: resume with "
                                f"--after {report.last}") from None
            report.adapters += len(page)
            report.last = page[-1].adapter_id
            bar.update(len(page))
    return report


def publish_page(catalog: Catalog, tier: StoreTier, page: list[PolicyRecord], pool: ThreadPoolExecutor,
                 workers: int) -> int:
    """One page: one listing tells which adapters the store has (those: the ordinary publish,
    one by one), the new ones go in `workers` segments at once; how many uploaded something."""
    held = stored_policies(tier.store, [p.adapter_id for p in page])
    fresh = [p for p in page if tier.store.policy_key(p.adapter_id) not in held]
    changed = sum(pool.map(tier.published, [p.adapter_id for p in page if p not in fresh]))
    step = -(-len(fresh) // workers) or 1
    parts = [fresh[i:i + step] for i in range(0, len(fresh), step)]
    list(pool.map(lambda part: write_segment(tier.store, catalog, part), parts))
    return changed + len(fresh)


def stored_policies(store: ObjectStore, adapter_ids: list[str]) -> set[str]:
    """The policy keys among those of `adapter_ids` that the store holds: one listing of their
    key range (a page of consecutive ids: about one request per thousand)."""
    keys = sorted(store.policy_key(a) for a in adapter_ids)
    # start just before the first key ("...json" > "...jso"), stop at the last
    return set(store.list_after("policies", keys[0][:-1], stop=keys[-1])) & set(keys)


def write_segment(store: ObjectStore, catalog: Catalog, policies: list[PolicyRecord]) -> None:
    """The blobs of `policies`' revisions as one segment, then each adapter's policy object."""
    adapters = []
    for policy in policies:
        records = [catalog.resolve(policy.adapter_id, rev) for rev in policy.revisions]
        adapters.append((policy, [(record, catalog.read_blob(record)) for record in records]))
    put_segment(store, adapters)


def put_segment(store: ObjectStore, adapters: list[tuple[PolicyRecord, list[tuple[RevisionRecord, bytes]]]], *,
                new_only: bool = False, pool: ThreadPoolExecutor | None = None) -> int:
    """The blobs of `adapters`' revisions end to end as one segment object, then one policy
    object each, whose `placed` gives every revision's record and place (on `pool`'s threads
    when given). `new_only`: each policy is a conditional PUT that only creates (If-None-Match),
    so an adapter the store holds already is left as it is there. How many policies were written."""
    entries = iter(store.put_segment([pair for _, revisions in adapters for pair in revisions]))
    docs = []
    for policy, revisions in adapters:
        placed = {record.revision: next(entries) for record, _ in revisions}
        policy.updated = time.time()
        docs.append(PolicyDoc(policy, {}, placed))
    put = functools.partial(_put_policy, store, new_only)
    return sum(pool.map(put, docs) if pool is not None else map(put, docs))


def _put_policy(store: ObjectStore, new_only: bool, doc: PolicyDoc) -> bool:
    if not new_only:
        store.put_policy(doc)
        return True
    try:
        store.put_if(store.policy_key(doc.policy.adapter_id), policy_bytes(doc))
    except WriteConflict:
        return False
    return True

