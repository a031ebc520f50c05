"""Where a request goes among engine replicas: the pure policy, no Ray import (the Serve router
in router.py and bench/cluster_sim.py run this same code).

Adapter requests: **rendezvous (highest-random-weight) hashing with bounded loads.** Every
replica gets a weight per adapter, `hash(replica, adapter)`; the adapter's preference order is
the replicas by falling weight. It goes to the first replica in that order whose load is under
the bound `ceil(c * (in flight + 1) / replicas)` (consistent hashing with bounded loads,
Mirrokni, Thorup and Zadimoghaddam 2018), so:

- the first request of an adapter already goes where the next ones will: the choice is a
  function of (adapter, live replicas, loads), not of what a replica reported holding;
- a replica leaving moves only its own adapters (the others' orders keep their first live
  replica), and one joining takes only the adapters it now tops (about 1/R of them);
- no replica takes a request past the bound while another has room under it: an adapter hot
  enough to fill its first choice spills to its *own* second choice (not one shared by every
  adapter), so a spill lands on a replica that is likely to have seen it before.

Base-only requests hold no adapter: the least loaded replica (ties broken at random).
"""
from __future__ import annotations

import math
import random
import weakref
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

import xxhash

DEFAULT_C = 1.25  # the load bound's slack over the mean (1.25: CHWBL's usual; >= 1)

R = TypeVar("R", bound=Hashable)


def weight(replica: str, key: str) -> int:
    """Rendezvous weight of `replica` for `key`: 64 bits of xxh3 over both, stable across
    processes and Python versions (never `hash()`, which is salted per process)."""
    return xxhash.xxh3_64_intdigest(f"{replica}\x00{key}".encode())


def preference(key: str, replicas: Iterable[R]) -> list[R]:
    """`replicas` in `key`'s rendezvous order, the most preferred first (ties, which need a
    64-bit collision, broken by the replica's name)."""
    return sorted(replicas, key=lambda r: (weight(str(r), key), str(r)), reverse=True)


def load_bound(total: int, replicas: int, c: float = DEFAULT_C) -> int:
    """The most requests a replica may hold once the next one is placed: c times the mean
    load counting that request, rounded up (>= 1, so an idle cluster takes anything)."""
    if replicas < 1:
        raise ValueError("need at least one replica")
    if c < 1:
        raise ValueError(f"the load bound's c must be >= 1, got {c}")
    return max(1, math.ceil(c * (total + 1) / replicas))


def spill_order(key: str, loads: Mapping[R, int], c: float = DEFAULT_C) -> list[R]:
    """Where a request for adapter `key` may go, best first: the replicas under the bound in
    `key`'s preference order, then those at or over it in the same order (tried only when
    none under it can take the request, e.g. every one is at its own concurrency cap).
    `loads`: replica -> requests it holds now (running and queued)."""
    return bounded(preference(key, loads), loads, c)


def bounded(order: Sequence[R], loads: Mapping[R, int], c: float = DEFAULT_C) -> list[R]:
    """`order` (a key's preference over the replicas of `loads`) with the replicas at or over
    the load bound moved last, keeping their order (a caller that caches preferences, like the
    simulator, skips the hashing)."""
    if not loads:
        return []
    bound = load_bound(sum(loads.values()), len(loads), c)
    return [r for r in order if loads[r] < bound] + [r for r in order if loads[r] >= bound]


def least_loaded(loads: Mapping[R, int], rng: random.Random | None = None) -> list[R]:
    """A base-only request's order: by load, ties shuffled (so equal replicas share them)."""
    pick = rng or random
    items = list(loads.items())
    pick.shuffle(items)
    return [r for r, _ in sorted(items, key=lambda item: item[1])]


def route(key: str | None, loads: Mapping[R, int], c: float = DEFAULT_C,
          rng: random.Random | None = None) -> list[R]:
    """The order to try replicas in for one request: `spill_order` for an adapter's (`key`
    its id), `least_loaded` for a base-only one (`key` None or "")."""
    return spill_order(key, loads, c) if key else least_loaded(loads, rng)


def owners(keys: Sequence[str], replicas: Sequence[R]) -> dict[str, R]:
    """Each key's first choice with no load in the way (what a replica's death may move)."""
    return {k: preference(k, replicas)[0] for k in keys}


# this process's routers (the ingress's handle to the engine deployment makes one), whose
# in-flight counts /metrics shows (loraserve_router_in_flight). Kept here, not in router.py:
# Serve pickles a router class *by value* (RequestRouterConfig), so router.py's globals in the
# process that routes are a copy, not the module anyone imports.
_ROUTERS: weakref.WeakSet = weakref.WeakSet()


def watch(router) -> None:
    """Show `router.in_flight` (replica id -> requests sent, not completed) in `in_flight()`."""
    _ROUTERS.add(router)


def in_flight() -> dict[str, int]:
    """replica name -> requests this process's routers sent it that have not completed (summed
    over routers; an atomic copy of each: Serve's router runs on a loop thread of its own)."""
    total: Counter[str] = Counter()
    for router in list(_ROUTERS):
        total.update({getattr(r, "unique_id", r): n for r, n in dict(router.in_flight).items()})
    return dict(total)
