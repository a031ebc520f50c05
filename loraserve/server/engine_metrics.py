"""The engine-core supervisor on the API server's /metrics, read at scrape time.

For a `CoreClient` (the engine in its own process; `engine.supervision()`):
`loraserve_engine_restarts_total{cause}` counts cores started again after one was lost (`exited`:
it died; `stalled`: no progress for the engine timeout, killed; `start_failed`: it never answered
its handshake), `loraserve_engine_up` is 1 while a core is up, beating and taking requests, and
`loraserve_engine_heartbeat_age_seconds` is how old its last beat is (absent while none is up).
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class EngineSupervisorCollector(Collector):
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        sup = self.engine.supervision()
        restarts = CounterMetricFamily(
            "loraserve_engine_restarts", "Engine cores started again after one died, stalled or "
            "failed to start, by cause", labels=["cause"])
        for cause, n in sorted(sup["restarts"].items()):
            restarts.add_metric([cause], n)
        yield restarts
        yield GaugeMetricFamily("loraserve_engine_up",
                                "1 while an engine core is up, beating and taking requests",
                                value=sup["up"])
        if sup["heartbeat_age_s"] is not None:
            yield GaugeMetricFamily("loraserve_engine_heartbeat_age_seconds",
                                    "Seconds since the engine core's last heartbeat",
                                    value=sup["heartbeat_age_s"])
        yield GaugeMetricFamily("loraserve_engine_restart_backoff_seconds",
                                "The wait before the next engine-core start, if one is lost now",
                                value=sup["backoff_s"])
