"""What a load test's samples say beyond TTFT and end to end: inter-token latency, tokens/s and
latency over time, hot against cold adapters, and goodput under a TTFT/ITL SLO.

- **ITL**: the gaps between a streamed request's text chunks (one chunk per engine step, so one
  token each, unless the server merged them); percentiles over every gap of every ok request.
- **Over time**: the run cut into `bins` equal windows by each request's end: ok requests,
  output tokens/s, and the median TTFT and end-to-end latency of the requests ending there.
- **Hot and cold**: a request is *cold* when it is the run's first for its adapter (the server
  may have to page it in), *hot* otherwise; each group's TTFT and end-to-end percentiles.
- **Goodput** (as vLLM's benchmark defines it): ok requests whose TTFT is within `--slo-ttft`
  and whose mean ITL (time per output token after the first) is within `--slo-itl`, per second
  of the run and as a share of all requests sent. An SLO not given does not constrain.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loraserve.loadgen.sample import Sample


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 and the mean (None each when there are no values)."""
    if not len(values):
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(values))}


def itl(samples: Sequence[Sample]) -> dict[str, float | None]:
    return percentiles([gap for s in samples if s.ok for gap in s.itl])


def over_time(samples: Sequence[Sample], wall: float, bins: int = 10) -> dict[str, list]:
    """Per window of the run (module doc): its end time, ok requests, output tokens/s, p50 TTFT
    and p50 end to end (None for a window where no request ended)."""
    width = max(wall, 1e-9) / bins
    ends: list[list[Sample]] = [[] for _ in range(bins)]
    for s in samples:
        if s.ok:
            ends[min(int((s.start + s.e2e) / width), bins - 1)].append(s)

    def median(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    return {"t_s": [(i + 1) * width for i in range(bins)],
            "ok": [len(b) for b in ends],
            "output_tokens_per_s": [sum(s.output_tokens for s in b) / width for b in ends],
            "ttft_p50_s": [median([s.ttft for s in b if s.ttft is not None]) for b in ends],
            "e2e_p50_s": [median([s.e2e for s in b]) for b in ends]}


def hot_cold(samples: Sequence[Sample]) -> dict[str, dict]:
    """TTFT and end-to-end percentiles of the cold (first per adapter) and hot ok requests."""
    out = {}
    for name, cold in (("cold", True), ("hot", False)):
        group = [s for s in samples if s.ok and s.cold == cold]
        out[name] = {"requests": len(group),
                     "ttft_s": percentiles([s.ttft for s in group if s.ttft is not None]),
                     "e2e_s": percentiles([s.e2e for s in group])}
    return out


def within_slo(s: Sample, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """Whether an ok request met both SLOs (module doc); a failed one never does."""
    if not s.ok:
        return False
    if slo_ttft is not None and (s.ttft is None or s.ttft > slo_ttft):
        return False
    return slo_itl is None or not s.itl or float(np.mean(s.itl)) <= slo_itl


def goodput(samples: Sequence[Sample], wall: float, slo_ttft: float | None,
            slo_itl: float | None) -> dict[str, float | None]:
    """Requests within the SLOs per second and as a share of all sent (module doc)."""
    good = sum(within_slo(s, slo_ttft, slo_itl) for s in samples)
    return {"slo_ttft_s": slo_ttft, "slo_itl_s": slo_itl, "good": good,
            "good_per_s": good / wall if wall > 0 else 0.0,
            "share": good / len(samples) if samples else None}
