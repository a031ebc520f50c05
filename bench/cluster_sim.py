"""Routing multi-LoRA traffic over R engine replicas: a discrete-event simulation (no engine).

    python bench/cluster_sim.py                        # R in 2, 16, 128; every policy
    python bench/cluster_sim.py --replicas 16 --requests 50000 --policies ray affinity

Each replica holds K adapters (an LRU of its device pool; a request for another one pages it in,
evicting the least recently used) and runs up to C requests at once (its batch); more queue at
the replica. Requests arrive as a Poisson process at `load` x the cluster's capacity; each asks
for one of 10^6 adapters drawn from a Zipf law (exponent `zipf`), and takes an exponential
service time (mean `service_s`) plus `page_in_s` when its adapter was not resident.

Policies (where a request goes):
  random         any replica, uniformly
  least_loaded   the replica with the fewest requests (running + queued): join-shortest-queue
  ray            Ray Serve's multiplexed routing, as `loraserve serve --replicas` uses it
                 (affinity, then spill): two random replicas among those holding the adapter
                 with room (< C in flight), the less loaded one; none holds it: two random
                 replicas among all with room; the holders are all full: spill the same way
  affinity       what `loraserve serve --replicas` routes with (loraserve/ray_serve/routing.py,
                 run here as is): the replicas holding the adapter first, in its rendezvous
                 order; else the less loaded of its first two rendezvous choices under the
                 bound ceil(c x (in flight + 1) / R) (c = 1.25), then the rest in its order;
                 past replicas whose batch is full (C running), as Serve's router skips a
                 replica at its max_ongoing_requests

Reported per (R, policy), over the requests after the first `warmup` fraction:
  hit rate            requests whose adapter was resident on the replica they went to
  page-ins/replica/s  misses per replica per simulated second
  imbalance           mean over arrivals of max/mean requests per replica (1.0 = even)
  wait p99            queueing delay at the replica, 99th percentile, seconds
"""
from __future__ import annotations

import argparse
import heapq
import math
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
from loraserve.ray_serve.routing import bounded, preference

POLICIES = ("random", "least_loaded", "ray", "affinity")


@dataclass(slots=True)
class SimConfig:
    replicas: int
    resident: int = 32          # K: adapters per replica (max_gpu_adapters)
    concurrency: int = 64       # C: requests a replica runs at once (max_batch_size)
    adapters: int = 1_000_000
    zipf: float = 1.1
    load: float = 0.7           # arrival rate / the cluster's service capacity
    service_s: float = 2.0      # mean service time of a request
    page_in_s: float = 0.05     # added to a request whose adapter was not resident
    requests: int = 100_000
    warmup: float = 0.2         # fraction of requests before measuring
    load_bound_c: float = 1.25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.resident < 1 or self.concurrency < 1 or self.adapters < 1:
            raise ValueError("replicas, resident, concurrency and adapters must be >= 1")
        if not 0 < self.load < 1:
            raise ValueError("load must be in (0, 1)")
        if self.zipf <= 0 or self.service_s <= 0 or self.page_in_s < 0:
            raise ValueError("need zipf > 0, service_s > 0, page_in_s >= 0")
        if not 0 <= self.warmup < 1 or self.requests < 10 or self.load_bound_c < 1:
            raise ValueError("need 0 <= warmup < 1, requests >= 10, load_bound_c >= 1")


@dataclass(slots=True)
class Replica:
    resident: OrderedDict = field(default_factory=OrderedDict)  # adapter -> None, LRU order
    running: int = 0
    queue: deque = field(default_factory=deque)  # (arrival, service) waiting for a batch slot

    @property
    def load(self) -> int:
        return self.running + len(self.queue)


class Cluster:
    """R replicas, their adapter LRUs, and which replicas hold each adapter (Serve's view)."""

    def __init__(self, cfg: SimConfig, rng: random.Random):
        self.cfg = cfg
        self.rng = rng
        self.replicas = [Replica() for _ in range(cfg.replicas)]
        self.holders: dict[int, set[int]] = {}
        self.in_flight = 0
        self.names = [f"replica-{r}" for r in range(cfg.replicas)]
        self.preferences: dict[int, list[int]] = {}  # adapter -> its rendezvous order, cached

    def touch(self, r: int, adapter: int) -> bool:
        """Use adapter on replica r: True for a hit; a miss pages it in, evicting the LRU."""
        lru = self.replicas[r].resident
        if adapter in lru:
            lru.move_to_end(adapter)
            return True
        if len(lru) >= self.cfg.resident:
            old, _ = lru.popitem(last=False)
            self.holders[old].discard(r)
        lru[adapter] = None
        self.holders.setdefault(adapter, set()).add(r)
        return False

    # -- policies ------------------------------------------------------------------------------
    def route(self, policy: str, adapter: int) -> int:
        return getattr(self, f"_{policy}")(adapter)

    def _random(self, adapter: int) -> int:
        return self.rng.randrange(self.cfg.replicas)

    def _least_loaded(self, adapter: int) -> int:
        loads = [r.load for r in self.replicas]
        low = min(loads)
        return self.rng.choice([i for i, x in enumerate(loads) if x == low])

    def _two_choices(self, candidates: list[int]) -> int:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(candidates, 2)
        return a if self.replicas[a].load <= self.replicas[b].load else b

    def _ray(self, adapter: int) -> int:
        cap = self.cfg.concurrency
        room = [r for r in self.holders.get(adapter, ()) if self.replicas[r].running < cap]
        if room:
            return self._two_choices(room)
        free = [i for i, r in enumerate(self.replicas) if r.running < cap]
        return self._two_choices(free or list(range(self.cfg.replicas)))

    def _affinity(self, adapter: int) -> int:
        order = self.preferences.get(adapter)
        if order is None:
            names = preference(f"t/{adapter}", self.names)
            order = self.preferences[adapter] = [int(n.rsplit("-", 1)[1]) for n in names]
        loads = {r: rep.load for r, rep in enumerate(self.replicas)}
        # the router's residency model is what it sent where: here, the pools themselves
        ranked = bounded(order, loads, self.cfg.load_bound_c, self.holders.get(adapter, ()))
        # Serve takes the first rank with room (< max_ongoing_requests = C running), else
        # waits; here the wait is at the first choice
        return next((r for r in ranked if self.replicas[r].running < self.cfg.concurrency),
                    ranked[0])


def zipf_draws(cfg: SimConfig, n: int, seed: int) -> np.ndarray:
    """n adapter ids in [0, adapters), P(k) ~ (k+1)^-zipf (inverse CDF over all of them)."""
    weights = np.arange(1, cfg.adapters + 1, dtype=np.float64) ** -cfg.zipf
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return np.searchsorted(cdf, np.random.default_rng(seed).random(n)).astype(np.int64)


@dataclass(slots=True)
class Result:
    replicas: int
    policy: str
    hit_rate: float
    page_ins_per_replica_s: float
    imbalance: float
    wait_p99_s: float
    wall_s: float


def simulate(cfg: SimConfig, policy: str) -> Result:
    """One run: the same arrivals and adapters for every policy (same seed)."""
    t0 = time.perf_counter()
    rng = random.Random(cfg.seed)
    cluster = Cluster(cfg, random.Random(cfg.seed + 1))
    adapters = zipf_draws(cfg, cfg.requests, cfg.seed)
    rate = cfg.load * cfg.replicas * cfg.concurrency / cfg.service_s
    done: list[tuple[float, int]] = []  # (finish time, replica)
    start_measure = int(cfg.requests * cfg.warmup)
    hits = misses = 0
    ratios: list[float] = []
    waits: list[float] = []
    now = t_measure = 0.0

    def begin(r: int, at: float, arrival: float, service: float) -> None:
        cluster.replicas[r].running += 1
        heapq.heappush(done, (at + service, r))
        if i >= start_measure:
            waits.append(at - arrival)

    for i, adapter in enumerate(adapters.tolist()):
        now += rng.expovariate(rate)
        while done and done[0][0] <= now:
            t, r = heapq.heappop(done)
            rep = cluster.replicas[r]
            rep.running -= 1
            cluster.in_flight -= 1
            if rep.queue:
                arrival, service = rep.queue.popleft()
                begin(r, t, arrival, service)
        if i == start_measure:
            t_measure = now
        r = cluster.route(policy, adapter)
        hit = cluster.touch(r, adapter)
        service = rng.expovariate(1 / cfg.service_s) + (0.0 if hit else cfg.page_in_s)
        cluster.in_flight += 1
        rep = cluster.replicas[r]
        if i >= start_measure:
            hits += hit
            misses += not hit
            if i % 8 == 0:  # sampled: O(R) per sample
                loads = [x.load for x in cluster.replicas]
                ratios.append(max(loads) / max(sum(loads) / len(loads), 1e-9))
        if rep.running < cfg.concurrency:
            begin(r, now, now, service)
        else:
            rep.queue.append((now, service))
    span = max(now - t_measure, 1e-9)
    return Result(cfg.replicas, policy, hits / (hits + misses), misses / cfg.replicas / span,
                  float(np.mean(ratios)), float(np.percentile(waits, 99)) if waits else 0.0,
                  time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 16, 128])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--resident", type=int, default=32, help="K: adapters per replica")
    p.add_argument("--concurrency", type=int, default=64, help="C: requests a replica runs at once")
    p.add_argument("--adapters", type=int, default=1_000_000)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--requests", type=int, default=None,
                   help="arrivals per run (default: 40,000 + 1,500 per replica)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"K={args.resident} C={args.concurrency} adapters={args.adapters} zipf={args.zipf} "
          f"load={args.load}")
    print(f"{'R':>4} {'policy':>13} {'hit rate':>9} {'page-ins/replica/s':>19} {'imbalance':>10} "
          f"{'wait p99 s':>11} {'wall s':>7}")
    for replicas in args.replicas:
        cfg = SimConfig(replicas=replicas, resident=args.resident, concurrency=args.concurrency,
                        adapters=args.adapters, zipf=args.zipf, load=args.load, seed=args.seed,
                        requests=args.requests or 40_000 + 1_500 * replicas)
        for policy in args.policies:
            r = simulate(cfg, policy)
            print(f"{r.replicas:>4} {r.policy:>13} {r.hit_rate:>9.3f} {r.page_ins_per_replica_s:>19.2f} "
                  f"{r.imbalance:>10.2f} {r.wait_p99_s:>11.3f} {r.wall_s:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
