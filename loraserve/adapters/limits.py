"""What an adapter must fit to be served, checked on both sides of the engine.

`PoolLimits` (the device pool's ranks and target kinds) and `check_base` (the base a revision
was exported for) are plain data and catalog errors: the engine core checks a revision with
them before it pages it in (`pool`, `pager`), and the API process checks a request or an import
with the same code before any bytes are read (`engine.directory`, `engine.client.catalog_view`,
the Ray ingress), without reaching into the device pool or the pager (an import contract keeps
this module free of both).
"""
from __future__ import annotations

from dataclasses import dataclass

from loraserve.catalog.errors import BaseMismatch


@dataclass(slots=True, frozen=True)
class PoolLimits:
    """What a pool can ever hold: ranks 1..max_rank on these target kinds. Plain data, so a
    process without the pool (an API server fronting an engine core) can check requests too."""

    max_rank: int
    kinds: tuple[str, ...]

    def check_admissible(self, rank: int, targets: list[str]) -> None:
        """ValueError unless an adapter of `rank` on `targets` (e.g. a RevisionRecord's) can ever
        be loaded: the quick check at request time, before any bytes are read."""
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"adapter rank {rank} is outside this server's LoRA ranks 1..{self.max_rank}")
        missing = [k for k in targets if k not in self.kinds]
        if missing:
            raise ValueError(f"adapter targets {', '.join(missing)}, which this server's base/pool "
                             f"has no LoRA for (pool kinds: {', '.join(self.kinds)})")


def check_base(ref: str, fingerprint: str, served: str) -> None:
    """BaseMismatch (409) unless revision `ref`, exported for `fingerprint`, fits the served base."""
    if fingerprint != served and not (hasattr(served, "accepts") and served.accepts(fingerprint)):
        hint = ""
        if fingerprint == getattr(served, "float_fingerprint", None):
            hint = (" (its float weights; this base is quantized differently: "
                    "--allow-quantized-base-adapters serves such adapters)")
        raise BaseMismatch(f"adapter {ref} was exported for base {fingerprint}, "
                           f"but the served base is {served}{hint}")
