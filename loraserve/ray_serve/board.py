"""What the ingress knows of its engine replicas, kept up by the replicas themselves.

Serve routes each handle call to one replica of its choosing, so the ingress cannot ask every
replica for anything. Instead each replica calls the ingress (`report`) every report interval
with its latest `EngineSnapshot` (a few KiB) and gets back the calls every replica's engine core
must answer (`engine.messages` calls in their wire form: an `Unload`, a `Residency`); their
answers come with its next report. A replica silent for `stale_after_s` is taken for gone: it
leaves /metrics and no command waits for it.

Event loop only (the ingress replica's): no locks.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from loraserve.engine.messages import Call, to_wire
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import EngineError
from loraserve.engine.wire import error_from_wire

WireCommand = list  # [seq, the call's wire form (engine.messages.to_wire)]
RESIDENCY = ("disk", "cpu", "gpu", "quarantined")  # a core's answers, nearest the device last


@dataclass(slots=True)
class Command:
    """A call every replica live when it was issued (`targets`) runs once."""

    seq: int
    call: Call
    targets: set[str]
    results: dict[str, list] = field(default_factory=dict)  # replica -> ["ok", value] | ["error", wire]
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def settle(self, live: set[str]) -> None:
        """Done once every target still live has answered."""
        if (self.targets & live) <= set(self.results):
            self.done.set()


@dataclass(slots=True)
class ReplicaState:
    snapshot: EngineSnapshot
    seen: float  # time.monotonic() of its last report


class ReplicaBoard:
    def __init__(self, stale_after_s: float = 5.0):
        self.stale_after_s = stale_after_s
        self.lost = 0  # replicas that went silent (killed, crashed, scaled away)
        self._replicas: dict[str, ReplicaState] = {}
        self._commands: dict[int, Command] = {}
        self._seq = itertools.count(1)

    # -- the replicas' side ----------------------------------------------------------------------
    def report(self, replica_id: str, snapshot: EngineSnapshot, seen: int,
               results: dict[int, list]) -> list[WireCommand]:
        """A replica's report: its snapshot and the results of commands up to `seen`; the
        commands issued after `seen` that it is to run."""
        self._replicas[replica_id] = ReplicaState(snapshot, time.monotonic())
        for seq, result in results.items():
            cmd = self._commands.get(seq)
            if cmd is not None:
                cmd.results[replica_id] = result
        live = set(self.live())
        for cmd in self._commands.values():
            cmd.settle(live)
        return [[c.seq, to_wire(c.call)] for c in self._commands.values() if c.seq > seen]

    # -- the ingress's side ----------------------------------------------------------------------
    def live(self) -> dict[str, EngineSnapshot]:
        """replica id -> latest snapshot, of the replicas that reported lately."""
        now = time.monotonic()
        for rid in [r for r, s in self._replicas.items() if now - s.seen > self.stale_after_s]:
            del self._replicas[rid]
            self.lost += 1
        return {rid: s.snapshot for rid, s in self._replicas.items()}

    async def broadcast(self, call: Call, timeout_s: float) -> dict[str, Any]:
        """Have every live replica's engine core answer `call` (its call id is each replica's
        own); replica id -> the answer's value. A replica that dies meanwhile is left out; an
        error a replica raised is raised here (EngineError)."""
        live = set(self.live())
        if not live:
            raise EngineError("no engine replica is up; retry later", status=503,
                              code="engine_unavailable")
        cmd = Command(next(self._seq), call, live)
        self._commands[cmd.seq] = cmd
        try:
            deadline = time.monotonic() + timeout_s
            while not cmd.done.is_set() and time.monotonic() < deadline:
                try:  # wake up now and then: a target may go stale without reporting
                    await asyncio.wait_for(cmd.done.wait(), min(1.0, timeout_s))
                except asyncio.TimeoutError:
                    cmd.settle(set(self.live()))
        finally:
            del self._commands[cmd.seq]
        if not cmd.done.is_set():
            raise EngineError(f"engine replicas did not answer {type(call).__name__} in {timeout_s:g} s",
                              status=504, code="replica_timeout")
        errors = [r[1] for r in cmd.results.values() if r[0] == "error"]
        if errors:
            raise error_from_wire(errors[0])
        return {rid: r[1] for rid, r in cmd.results.items()}


def merged(snaps: list[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot standing for all replicas: counts summed, fractions averaged, adapter sets
    united; no tier stats (those are per replica, see router_metrics.labelled_snapshots)."""
    if not snaps:
        return EngineSnapshot()
    total = {name: sum(getattr(s, name) for s in snaps)
             for name in ("running", "waiting", "parked", "batch_size", "preemptions", "max_lora",
                          "num_kv_blocks", "prefix_cache_queries", "prefix_cache_hits")}
    return EngineSnapshot(
        **total, kv_usage=sum(s.kv_usage for s in snaps) / len(snaps),
        prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in snaps) / len(snaps),
        running_adapters=tuple(sorted({a for s in snaps for a in s.running_adapters})),
        waiting_adapters=tuple(sorted({a for s in snaps for a in s.waiting_adapters})),
        resident=frozenset().union(*(s.resident for s in snaps)),
        published=max(s.published for s in snaps))


def nearest(answers: list[list[str]]) -> list[str]:
    """Per key, the residency nearest the device among the replicas' answers to one
    `Residency` call (a list per replica): quarantined on any replica, else gpu on any, else
    cpu on any, else disk."""
    return [max(column, key=RESIDENCY.index) for column in zip(*answers)]
