"""What other threads may know about the engine: an immutable snapshot the engine thread publishes.

The engine thread is the only writer of the scheduler, the block manager and the device adapter
pool. The HTTP loop (`/metrics`, `/v1/models`) never reads those containers; it reads the latest
`EngineSnapshot`, which the engine replaces (one reference assignment, atomic in Python) after
applying commands, when it goes idle, and at most every `PUBLISH_EVERY_S` while it steps (in an
engine-core process, the snapshot travels with the step's deltas: a `messages.Step`). A
revision's residency for `/v1/adapters/{id}` is the one exception: on every hosting the engine
core answers a `Residency` call on its own thread (`core.engine_core.EngineCore.residency`).

The snapshot's detail (`DETAIL_FIELDS`: which revisions each tier holds, the tiers' counters,
the page-in histogram) grows with the adapter tiers, and reading it was the larger part of a
publish: on a cold workload, with the CPU tier's 1024 most recent revisions, a publish took
~0.4 ms of the engine thread every step, and the API process spent ~1.8 ms decoding each
snapshot sent. So while the engine steps, the detail is read again at most every
`DETAIL_EVERY_S` (a publish in between carries the last one over, the same objects), and an
engine-core process sends it to its API server only when it was read again (`Step.detail`). A
forced publish (the engine idle, an operator call returning) always reads it, so what a client
sees once its call returned or the engine went quiet is current; while the engine is busy it is
at most `DETAIL_EVERY_S` old.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PUBLISH_EVERY_S = 0.01
DETAIL_EVERY_S = 0.5  # while stepping, the detail is read again at most this often
CPU_RESIDENT_MAX = 1024  # CPU-tier revisions a snapshot names

AdapterKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    running: int = 0
    waiting: int = 0
    parked: int = 0                       # waiting for their adapter to page in
    batch_size: int = 0                   # sequences in the last step
    kv_usage: float = 0.0                 # fraction of KV blocks in use
    preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queries: int = 0         # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0            # of those, found cached (their K/V not computed again)
    running_adapters: tuple[str, ...] = ()  # adapters (names as asked) with a running sequence, sorted
    waiting_adapters: tuple[str, ...] = ()  # the same, with a waiting or parked sequence
    resident: frozenset[AdapterKey] = frozenset()  # (adapter_id, revision) in the device pool
    pinned: tuple[AdapterKey, ...] = ()   # of `resident`, those pinned (--pin): never evicted
    # the CPU tier's revisions, most recently used first, at most CPU_RESIDENT_MAX of them
    # (vllm:lora_adapter_loaded{level="cpu"}; the tier's count is `cpu_cache.entries`)
    cpu_resident: tuple[AdapterKey, ...] = ()
    pool: object | None = None            # adapters.stats.PoolStats copy; None without a catalog
    cpu_cache: object | None = None       # adapters.stats.CacheStats copy
    pager: object | None = None           # adapters.stats.PagerStats copy
    page_in_samples: tuple = ()           # (name, labels, value) of the page-in histogram
    max_lora: int = 0                     # device pool slots
    num_kv_blocks: int = 0                # KV cache blocks (vllm:cache_config_info)
    quarantined: tuple[tuple[str, str, str], ...] = ()  # (adapter_id, revision, why): never served again
    # (bucket, state) of the CPU decode step's background compile: pending | compiling |
    # compiled | eager | failed (engine.core.background_compile); () when nothing compiles
    compile: tuple[tuple[str, str], ...] = ()
    published: float = 0.0                # time.monotonic() of publication
    detail_at: float = 0.0                # time.monotonic() when the DETAIL_FIELDS were read

    def stats(self) -> dict:
        """The gauges the server exports (`engine.stats()`)."""
        return {"running": self.running, "waiting": self.waiting, "parked": self.parked,
                "batch_size": self.batch_size, "kv_usage": self.kv_usage,
                "preemptions": self.preemptions, "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits}

    def with_detail_of(self, other: EngineSnapshot) -> EngineSnapshot:
        """This snapshot with `other`'s detail (a peer's snapshot sent without its detail, which
        it carried over from the one before)."""
        return dataclasses.replace(self, **{name: getattr(other, name) for name in DETAIL_FIELDS})

    def compiling(self) -> list[str]:
        """The decode buckets not made yet (pending or compiling)."""
        return [b for b, st in self.compile if st in ("pending", "compiling", "measuring")]

    def quarantine_reason(self, key: AdapterKey) -> str | None:
        """Why revision `key` is quarantined (its numbers went non-finite), None if it is not."""
        return next((why for aid, rev, why in self.quarantined if (aid, rev) == key), None)

    def resident_ids(self) -> list[str]:
        return sorted({aid for aid, _ in self.resident})


# the fields read at most every DETAIL_EVERY_S while the engine steps (module doc); `detail_at`
# says when, and is how a sender knows whether its peer has them already
DETAIL_FIELDS = ("resident", "pinned", "cpu_resident", "pool", "cpu_cache", "pager", "page_in_samples",
                 "detail_at")
