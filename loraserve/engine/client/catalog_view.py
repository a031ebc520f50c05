"""What an API process may use of the adapter tiers, on every hosting.

`CatalogView` is the `catalog` of every `EngineClient` (`interface.CatalogView` is what the
HTTP side sees of it): the catalog (listings, imports, descriptions), the `AdapterDirectory`
over it, and warming and residency through whoever runs the engine (`warm_on`: a callable
that pages a revision into that engine's CPU tier, a `Warm` call). Where the engine runs
elsewhere (the process transport: an engine-core process; the Ray Serve ingress: engines in replicas)
the view opens the catalog in this process through shard hosts (`open`), and the engine's pool
limits and base fingerprint arrive with its handshake (`learn`); until then only the base
resolves. In process (the thread transport) it is a view of the engine's own catalog and directory,
never of the engine thread's `AdapterManager`.
"""
from __future__ import annotations

from collections.abc import Callable

from loraserve.catalog.isolated import open_for_serving
from loraserve.catalog.records import RevisionRecord

from ...adapters.manager import describe_adapter
from ...adapters.limits import PoolLimits
from ..directory import EVERYONE, AdapterDirectory


class CatalogView:
    def __init__(self, directory: AdapterDirectory, warm_on: Callable[[RevisionRecord], None],
                 owned: bool = False):
        """A view of `directory`'s catalog (not None); `owned`: `close` closes it (`open`)."""
        self.catalog, self._owned = directory.catalog, owned
        self.directory = directory
        self._warm_on = warm_on

    @classmethod
    def open(cls, catalog_dir: str, base_name: str, warm_on: Callable[[RevisionRecord], None],
             base_fingerprint: str = "", readonly: bool = False) -> CatalogView:
        """The catalog at catalog_dir, opened here (shard hosts map the shards; `close` closes
        it); `readonly`: this process never writes it (a Ray Serve engine replica)."""
        catalog = open_for_serving(catalog_dir, readonly=readonly)
        return cls(AdapterDirectory(base_name, catalog, base_fingerprint), warm_on, owned=True)

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
        """Close the catalog `open` opened (an in-process engine closes its own)."""
        if self._owned:
            self.catalog.close()
