"""What an API process may use of the adapter tiers when the engine runs elsewhere.

`CatalogView` is the `adapter_manager` of `CoreClient` (the engine in an engine-core process)
and of the Ray Serve ingress (engines in replicas): the catalog, opened in this process through
shard hosts (listings, imports, descriptions), the `AdapterDirectory` over it, and warming and
residency through whoever runs the engine (`warm_on`: a callable that pages a revision into
that engine's CPU tier). The engine's pool limits and base fingerprint arrive with its
handshake (`learn`); until then only the base resolves.
"""
from __future__ import annotations

from collections.abc import Callable

from loraserve.catalog.isolated import open_for_serving
from loraserve.catalog.records import RevisionRecord

from ...adapters.manager import describe_adapter
from ...adapters.pool import PoolLimits
from ..directory import EVERYONE, AdapterDirectory


class CatalogView:
    def __init__(self, catalog_dir: str, base_name: str, warm_on: Callable[[RevisionRecord], None],
                 base_fingerprint: str = "", readonly: bool = False):
        """`readonly`: this process never writes the catalog (a Ray Serve engine replica)."""
        self.catalog = open_for_serving(catalog_dir, readonly=readonly)  # shard hosts map the shards
        self.directory = AdapterDirectory(base_name, self.catalog, base_fingerprint)
        self._warm_on = warm_on

    def learn(self, base_fingerprint: str, limits: PoolLimits) -> None:
        """The engine's base fingerprint and pool limits (its handshake)."""
        self.directory.base_fingerprint = base_fingerprint
        self.directory.limits = limits

    @property
    def base_fingerprint(self) -> str:
        return self.directory.base_fingerprint

    @property
    def pool(self) -> PoolLimits:
        """The engine's pool limits (what an adapter must fit to be served)."""
        return self.directory.limits

    def resolve(self, ref: str) -> RevisionRecord:
        """The revision `ref` names, for an operator call (any tenant): the directory's rule."""
        return self.directory.resolve(ref, EVERYONE).record

    def warm(self, ref: str) -> tuple[str, str]:
        """Blocking (a worker thread): resolve ref and have the engine page it into its CPU tier."""
        rec = self.resolve(ref)
        self._warm_on(rec)
        return rec.adapter_id, rec.revision

    def describe(self, adapter_id: str, residency) -> dict:
        return describe_adapter(self.catalog, adapter_id, residency)

    def close(self) -> None:
        self.catalog.close()
