"""The API server's configuration, beside the engine's (`engine.config.EngineConfig`).

`EngineConfig` says what the engine serves and how (model, catalog, tiers, batches); it travels
to the engine-core process and to Ray replicas. `ServerConfig` says how the HTTP side treats
requests (auth, body and sequence bounds, the drain), and stays in the API process (the Ray
ingress gets it as its deployment's argument). `loraserve serve` builds both from its flags; a
field's `metadata["help"]` is its flag's help.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(slots=True)
class ServerConfig:
    api_key: str | None = None  # one admin key (--api-key, else $LORASERVE_API_KEY)
    keys: str | os.PathLike | None = None  # the keys file (server/tenancy.py)
    metrics_key: str | None = None  # a key that may read /metrics only
    audit_log: str | os.PathLike | None = None  # control-plane actions, as JSON lines
    max_n: int = 16  # `n` per request
    max_request_bytes: int = field(default=16 * 2**20, metadata={
        "help": "largest request body in bytes; a larger one gets 413 before it is parsed"})
    max_seqs_per_request: int = field(default=256, metadata={
        "help": "sequences (prompts x n) one request may start; more is a 400"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "seconds in-flight requests may run on after SIGTERM; then they end with a "
                "clean error (503, or an error event in a stream)"})
    # vLLM's --tool-call-parser: the tool-call format of a chat template that renders tools
    # (server/tool_calls.PARSERS), instead of the one its markers say; None: read off the template
    tool_call_parser: str | None = None
    # X-Request-Id on every response (server/request_log.py); False behind a proxy that echoes
    # it itself (Ray Serve's), where the app only reads and logs it
    echo_request_id: bool = True

    def __post_init__(self) -> None:
        for name in ("max_n", "max_request_bytes", "max_seqs_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_call_parser is not None:
            from loraserve.server.tool_calls import check_parser
            check_parser(self.tool_call_parser)  # ValueError listing the ones parsed
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
