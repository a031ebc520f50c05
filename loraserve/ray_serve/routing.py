"""Where a request goes among engine replicas: the pure policy, no Ray import (the Serve router
in router.py and bench/cluster_sim.py run this same code).

Adapter requests: **rendezvous (highest-random-weight) hashing with bounded loads, held
adapters first.** Every replica gets a weight per adapter, `hash(replica, adapter)`; the
adapter's preference order is the replicas by falling weight. In that order:

1. the replicas that hold the adapter (`Residency`, the router's own model of each replica's
   device pool, from the requests it sent there): a hit is worth more than balance, and Serve
   skips a replica whose batch is full (max_ongoing_requests), so a holder takes the adapter's
   requests until its batch is full;
2. not held anywhere (or every holder full): the less loaded of the adapter's first two
   choices under the bound `ceil(c * (in flight + 1) / replicas)` (consistent hashing with
   bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018; ties go to the first choice);
3. the other replicas under the bound, then those at or over it.

So:

- the first request of an adapter already goes where the next ones will: with nothing in
  flight it goes to its first choice, which holds it from then on (no waiting for a replica to
  report what it holds);
- a replica leaving moves only its own adapters (the others' holders stay), and one joining
  takes no adapter a replica holds: only placements of adapters held nowhere that rank it
  among their first two choices;
- a new (or evicted) adapter is never placed on a replica past the bound while one of its
  first two choices is under it.

Why holders first and not the bound for every request (what this module did first): on 2
replicas with batches of 4 and 6 to 100 adapters, spilling a held adapter at the bound
(2 in flight of 4) cost a page-in and a second slot on the other replica for little balance;
its device-pool hit rate fell 3 to 13 points under Serve's default multiplexing, which stays
with a holder until its batch is full (bench/RESULTS.md, issue 26).

Base-only requests hold no adapter: the least loaded replica (ties broken at random).
"""
from __future__ import annotations

import math
import random
import weakref
from collections import Counter, OrderedDict
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
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


def spill_order(key: str, loads: Mapping[R, int], c: float = DEFAULT_C,
                held: Collection[R] = ()) -> list[R]:
    """Where a request for adapter `key` may go, best first (see the module's docstring):
    the replicas in `held` (those holding it), then placement under the bound, then the rest.
    `loads`: replica -> requests it holds now (running and queued). Serve tries them in this
    order and takes the first with a free batch slot."""
    return bounded(preference(key, loads), loads, c, held)


def bounded(order: Sequence[R], loads: Mapping[R, int], c: float = DEFAULT_C,
            held: Collection[R] = ()) -> list[R]:
    """`order` (a key's preference over the replicas of `loads`) ranked as `spill_order` says
    (a caller that caches preferences, like the simulator, skips the hashing)."""
    if not loads:
        return []
    bound = load_bound(sum(loads.values()), len(loads), c)
    holders = [r for r in order if r in held]
    under = [r for r in order if r not in held and loads[r] < bound]
    first_two = sorted((r for r in order[:2] if r in under), key=lambda r: loads[r])  # stable
    return (holders + first_two + [r for r in under if r not in first_two]
            + [r for r in order if r not in held and loads[r] >= bound])


class Residency:
    """The router's model of what each replica's device pool holds: per replica, an LRU of the
    `slots` adapters it was last sent requests for (the engine's device pool is an LRU of
    --max-gpu-adapters slots). The ingress's router sends every request, so it knows at once
    what Serve's multiplexing learns from the replicas' reports a second later."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"need at least one adapter slot, got {slots}")
        self.slots = slots
        self.pools: dict[Hashable, OrderedDict[str, None]] = {}

    def touch(self, replica: Hashable, key: str) -> None:
        """A request for adapter `key` went to `replica`: it holds `key` now, the most recent."""
        pool = self.pools.setdefault(replica, OrderedDict())
        pool[key] = None
        pool.move_to_end(key)
        if len(pool) > self.slots:
            pool.popitem(last=False)

    def holders(self, key: str, replicas: Iterable[R]) -> list[R]:
        """Those of `replicas` that hold `key`."""
        return [r for r in replicas if key in self.pools.get(r, ())]

    def forget(self, replica: Hashable) -> None:
        """`replica` is gone (or was replaced): nothing is held there."""
        self.pools.pop(replica, None)

    def keep(self, replicas: Collection[Hashable]) -> None:
        """Forget every replica not among the live `replicas`."""
        for gone in [r for r in self.pools if r not in replicas]:
            del self.pools[gone]


def least_loaded(loads: Mapping[R, int], rng: random.Random | None = None) -> list[R]:
    """A base-only request's order: by load, ties shuffled (so equal replicas share them)."""
    pick = rng or random
    items = list(loads.items())
    pick.shuffle(items)
    return [r for r, _ in sorted(items, key=lambda item: item[1])]


def route(key: str | None, loads: Mapping[R, int], c: float = DEFAULT_C,
          rng: random.Random | None = None, held: Collection[R] = ()) -> list[R]:
    """The order to try replicas in for one request: `spill_order` for an adapter's (`key`
    its id, `held` the replicas holding it), `least_loaded` for a base-only one (`key` None
    or "")."""
    return spill_order(key, loads, c, held) if key else least_loaded(loads, rng)


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


def routable() -> set[str]:
    """The replica names this process's routers route to now: the live set Serve's controller
    last sent them (a replica may report to the ingress a moment before its router learns of
    it; until then no request goes there)."""
    names: set[str] = set()
    for router in list(_ROUTERS):
        names.update(r.unique_id for r in list(router.curr_replicas))
    return names
