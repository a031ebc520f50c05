"""`LoadTestConfig`: one load test's settings, checked as it is made (the `--client` choices,
open or closed loop, the adapter popularity `--dist`)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

CLIENTS = ("raw", "httpx", "wrk")


@dataclass(slots=True)
class LoadTestConfig:
    """One load test. Exactly one of `rate` (open loop) and `concurrency` (closed loop)."""

    url: str
    adapters: list[str] = field(default_factory=list)  # model refs; empty = base model only
    base_model: str | None = None  # the served base name; None = ask /v1/models when needed
    rate: float | None = None
    concurrency: int | None = None
    dist: str = "uniform"  # "uniform" | "zipf:S" | "cycle" (each adapter in turn: a sweep)
    duration: float = 30.0
    max_requests: int | None = None
    prompt_len: int = 32  # words
    max_tokens: int = 32
    ignore_eos: bool = True
    temperature: float = 0.0
    model_field: str = "model"  # request field that carries the adapter id
    api_key: str | None = None
    timeout: float = 120.0
    seed: int = 0
    progress: bool = True
    client: str = "raw"  # "raw" (built-in HTTP/1.1), "httpx", or "wrk" (closed loop, if installed)
    report_dir: str | None = None  # write report.html and summary.json here
    scrape_interval: float = 1.0  # seconds between /metrics scrapes for the report's timelines
    wrk_threads: int = 1
    stream: bool = True  # False: plain JSON answers (TTFT = end to end; built-in client and wrk)
    slo_ttft: float | None = None  # goodput: a request's TTFT within this (seconds)
    slo_itl: float | None = None   # goodput: its mean inter-token latency within this (seconds)
    max_error_rate: float | None = None  # the command fails when errors / requests exceed this
    zipf_s: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of --rate (open loop) and --concurrency (closed loop)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not self.duration > 0 or self.prompt_len < 1 or self.max_tokens < 1 or self.timeout <= 0:
            raise ValueError("--duration, --prompt-len, --max-tokens and --timeout must be positive")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if not self.model_field:
            raise ValueError("--model-field must name a request field")
        if self.client not in CLIENTS:
            raise ValueError(f"--client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if self.client == "wrk" and (self.rate is not None or self.max_requests is not None):
            raise ValueError("--client wrk runs a closed loop for a duration: use --concurrency, not "
                             "--rate or --requests")
        if self.client == "httpx" and not self.stream:
            raise ValueError("--no-stream needs --client raw or wrk")
        if self.report_dir is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--report draws with matplotlib: pip install 'loraserve[report]'")
        if not self.scrape_interval > 0 or self.wrk_threads < 1:
            raise ValueError("--scrape-interval and --wrk-threads must be positive")
        for name in ("slo_ttft", "slo_itl"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
        if self.max_error_rate is not None and not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"--max-error-rate must be in [0, 1], got {self.max_error_rate}")
        self.zipf_s = _parse_dist(self.dist)


def _parse_dist(dist: str) -> float | None:
    """`uniform` or `cycle` -> None, `zipf:S` -> S (> 0)."""
    if dist in ("uniform", "cycle"):
        return None
    kind, _, s = dist.partition(":")
    try:
        value = float(s)
    except ValueError:
        value = 0.0
    if kind != "zipf" or not value > 0:
        raise ValueError(f"--dist must be 'uniform', 'cycle' or 'zipf:S' with S > 0, got {dist!r}")
    return value
