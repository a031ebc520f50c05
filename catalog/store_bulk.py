"""Publish a whole catalog into its durable tier: batched, parallel, resumable, with a progress bar.

`loraserve catalog publish DIR --store s3://bucket/prefix` is how a catalog built locally (by
`catalog materialize`, imports, an rsync'd copy) becomes the store's: adapters are read a page
at a time in id order, and each page's adapters are published on `workers` threads
(`StoreTier.published`: blobs the store lacks, records, the policy). Publishing is idempotent
and skips what the store already holds as it is here (one policy read per adapter), so an
interrupted run is resumed by running it again; `--after ID` starts past an id instead.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from .store import Catalog
from .store_s3 import StoreTier

PAGE = 1000


@dataclass(slots=True)
class PublishReport:
    adapters: int = 0  # seen
    published: int = 0  # uploaded something
    last: str | None = None  # the last adapter id done (a resume point)


def publish_catalog(catalog: Catalog, tier: StoreTier, *, workers: int = 8, after: str | None = None,
                    progress: bool = True) -> PublishReport:
    """Publish every adapter of `catalog` (after id `after`) through `tier` (module doc)."""
    report = PublishReport(last=after)
    total = catalog.stats()["adapters"] if progress else None
    with ThreadPoolExecutor(workers, thread_name_prefix="loraserve-publish") as pool, \
            tqdm(total=total, unit="adapter", disable=not progress, desc="publish") as bar:
        while True:
            page = [p.adapter_id for p in catalog.list(limit=PAGE, after=report.last)]
            if not page:
                return report
            for changed in pool.map(tier.published, page):
                report.published += int(changed)
            report.adapters += len(page)
            report.last = page[-1]
            bar.update(len(page))
