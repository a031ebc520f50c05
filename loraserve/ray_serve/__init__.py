"""`loraserve serve --replicas N`: the same API served by Ray Serve, N engine replicas behind one
FastAPI ingress, requests routed to the replicas that hold their adapter.

Nothing here is imported unless --replicas is given (`ray` is an optional extra,
`loraserve[ray]`): `config`, `drain` and `shutdown` have no Ray import; the entries are
`launch.run` (the CLI: serves until SIGTERM/SIGINT, drains, stops Ray, ends the process) and
`launch.start` (a caller that owns its process).

  ingress (1 replica)           the existing FastAPI app (routes, auth, tenants, error bodies)
    EngineClient                the API side's one engine client, its transport a
      over RayTransport         Serve deployment handle to ...
  EngineReplica (N replicas)    one CoreClient each (an engine-core process, supervised) over
                                the same EngineConfig, catalog read-only; `@serve.multiplexed`
                                on the adapter id, so Serve's router prefers a replica that
                                already holds a request's adapter
"""
