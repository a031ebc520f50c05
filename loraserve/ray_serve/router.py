"""The engine deployment's Serve request router: routing.py's policy inside Serve's pluggable
`RequestRouter`, so every handle call the ingress makes (generation, warm, residency) is placed
by it and nothing routes beside Serve.

Serve calls `choose_replicas` for each pending request with the live replicas; it returns
ranks, and Serve takes the first rank holding a replica with room (fewer than
`max_ongoing_requests` in flight), backing off and asking again when none has. The ranks here
are one replica each, in `routing.route`'s order: the replicas holding the adapter, then the
less loaded of its first two rendezvous choices under the load bound, then the rest (or least
loaded first for a base-only call). What a replica holds is this router's own model
(`routing.Residency`, an LRU of --max-gpu-adapters per replica, touched by each generation a
replica accepts), not what Serve's multiplexing learns from the replicas' reports later.

Loads are this router's own count of the requests it sent and that have not completed (the
ingress is the one caller of the engine deployment, so its count is the replicas' load, with
no probe and no staleness; the ingress's /metrics shows it, `loraserve_router_in_flight`).
The adapter is the handle's multiplexed model id; the replica's name is its Serve unique id
(what `x-loraserve-replica` carries).

Selected with `request_router_config=RequestRouterConfig(request_router_class=ROUTER_PATH,
request_router_kwargs={"c": ..., "slots": ...})` on the engine deployment (launch.application).
"""
from __future__ import annotations

from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .routing import DEFAULT_C, Residency, route, watch

ROUTER_PATH = "loraserve.ray_serve.router.AffinityRouter"
PAGING_CALLS = frozenset({"generate"})  # the replica calls that page an adapter into the pool


class AffinityRouter(RequestRouter):
    """Rendezvous hashing with bounded loads, held adapters first, for adapters; least loaded
    for the base."""

    def initialize_state(self, c: float = DEFAULT_C, slots: int = 1) -> None:
        """`c`: the load bound's; `slots`: each replica's device adapter slots
        (--max-gpu-adapters), the size of its pool in this router's residency model."""
        if c < 1:
            raise ValueError(f"the load bound's c must be >= 1, got {c}")
        self.c = c
        self.in_flight: Counter[ReplicaID] = Counter()
        self.residency = Residency(slots)
        watch(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {name: self.in_flight[r.replica_id] for name, r in by_name.items()}
        key = pending_request.metadata.multiplexed_model_id if pending_request else ""
        if pending_request is not None:
            # every rank was offered: back off before asking again (Serve's default is to
            # retry at once, which is for routers with a cheaper first pass)
            pending_request.routing_context.should_backoff = True
        self.residency.keep(by_name)  # a replaced replica's pool went with it
        held = self.residency.holders(key, by_name) if key else ()
        return [[by_name[name]] for name in route(key, loads, self.c, held=held)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        """A replica accepted a request: a generation pages its adapter into that replica's
        device pool (called for every accepted request: Serve's strict max_ongoing_requests,
        on by default, has each replica accept or reject)."""
        meta = pending_request.metadata
        if meta.multiplexed_model_id and meta.call_method in PAGING_CALLS:
            self.residency.touch(replica_id.unique_id, meta.multiplexed_model_id)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Every sent request completes once: a rejected one (Serve cancels it), and a stream
        whose client went away (Serve's proxy cancels the ingress's request, which cancels the
        replica's stream, frontend._stream; the end of a cancelled stream is its completion
        here). tests/test_ray_serve.py closes streams early and sees the counts back at 0."""
        if self.in_flight[replica_id] > 1:
            self.in_flight[replica_id] -= 1
        else:
            del self.in_flight[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
        self.residency.forget(replica_id.unique_id)
