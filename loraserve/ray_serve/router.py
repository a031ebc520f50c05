"""The engine deployment's Serve request router: routing.py's policy inside Serve's pluggable
`RequestRouter`, so every handle call the ingress makes (generation, warm, residency) is placed
by it and nothing routes beside Serve.

Serve calls `choose_replicas` for each pending request with the live replicas; it returns
ranks, and Serve takes the first rank holding a replica with room (fewer than
`max_ongoing_requests` in flight), backing off and asking again when none has. The ranks here
are one replica each, in `routing.route`'s order: the adapter's rendezvous order with the
replicas at or over the load bound moved last (or least loaded first for a base-only call).

Loads are this router's own count of the requests it sent and that have not completed (the
ingress is the one caller of the engine deployment, so its count is the replicas' load, with
no probe and no staleness; the ingress's /metrics shows it, `loraserve_router_in_flight`).
The adapter is the handle's multiplexed model id; the replica's name is its Serve unique id
(what `x-loraserve-replica` carries).

Selected with `request_router_config=RequestRouterConfig(request_router_class=ROUTER_PATH,
request_router_kwargs={"c": ...})` on the engine deployment (launch.application).
"""
from __future__ import annotations

from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .routing import DEFAULT_C, route, watch

ROUTER_PATH = "loraserve.ray_serve.router.AffinityRouter"


class AffinityRouter(RequestRouter):
    """Rendezvous hashing with bounded loads for adapters, least loaded for the base."""

    def initialize_state(self, c: float = DEFAULT_C) -> None:
        if c < 1:
            raise ValueError(f"the load bound's c must be >= 1, got {c}")
        self.c = c
        self.in_flight: Counter[ReplicaID] = Counter()
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
        return [[by_name[name]] for name in route(key, loads, self.c)]

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
