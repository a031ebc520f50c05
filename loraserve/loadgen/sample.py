"""One request of a load test and its outcome (`Sample`): sent by the built-in HTTP/1.1 client
(`request_raw`, SSE events parsed as they arrive) or by httpx (`request_httpx`, `--client httpx`:
the general-purpose client the built-in one replaced, kept for comparison)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httptools
import httpx
import orjson

from loraserve.loadgen.client import HTTPClient


@dataclass(slots=True)
class Sample:
    """The outcome of one request (times in seconds from its start)."""

    ok: bool
    e2e: float
    ttft: float | None = None
    output_tokens: int = 0
    error: str | None = None  # "http 404", "ReadTimeout", ...
    start: float = 0.0  # seconds from the start of the run
    itl: list[float] = field(default_factory=list)  # gaps between streamed text chunks
    cold: bool = False  # the run's first request for its adapter (or the base)


async def request_httpx(client: httpx.AsyncClient, body: dict) -> Sample:
    """Stream one completion with httpx (`--client httpx`), timing the first text and the end."""
    start = time.perf_counter()
    ttft, chunks, usage, itl, last = None, 0, None, [], 0.0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return Sample(False, time.perf_counter() - start, error=f"http {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return Sample(False, time.perf_counter() - start, error="stream error")
                usage = (event.get("usage") or {}).get("completion_tokens", usage)
                if any(c.get("text") for c in event.get("choices", ())):
                    chunks += 1
                    now = time.perf_counter()
                    if ttft is not None:
                        itl.append(now - last)
                    ttft, last = (ttft if ttft is not None else now - start), now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Sample(False, time.perf_counter() - start, error=type(e).__name__)
    e2e = time.perf_counter() - start
    return Sample(True, e2e, ttft if ttft is not None else e2e, usage if usage is not None else chunks,
                  itl=itl)


class _Events:
    """The sink of one streamed response (built-in client): SSE events parsed as they arrive."""

    __slots__ = ("start", "buf", "ttft", "chunks", "usage", "error", "stream", "itl", "last")

    def __init__(self, start: float, stream: bool = True):
        self.start = start
        self.stream = stream
        self.buf = b""
        self.ttft: float | None = None
        self.chunks = 0
        self.usage: int | None = None
        self.error: str | None = None
        self.itl: list[float] = []  # inter-token latency: the gaps between text chunks
        self.last = 0.0

    def feed(self, data: bytes) -> None:
        if not self.stream:
            self.buf += data
            return
        buf = self.buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self.buf = buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]" or self.error is not None:
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = "JSONDecodeError"
            return
        if "error" in event:
            self.error = "stream error"
            return
        usage = event.get("usage")
        if usage:
            self.usage = usage.get("completion_tokens", self.usage)
        if any(c.get("text") for c in event.get("choices", ())):
            self.chunks += 1
            if self.stream:
                now = time.perf_counter()
                if self.ttft is None:
                    self.ttft = now - self.start
                else:
                    self.itl.append(now - self.last)
                self.last = now

    def finish(self) -> None:
        if not self.stream:  # one JSON answer
            try:
                self._data(self.buf)
            except AttributeError:
                self.error = "unexpected answer"
            return
        if self.buf.strip():
            self.feed(b"\n\n")


async def request_raw(client: HTTPClient, data: bytes, stream: bool = True) -> Sample:
    """One completion with the built-in client (`data`: the prebuilt request)."""
    start = time.perf_counter()
    events = _Events(start, stream)
    try:
        status = await client.request(data, events.feed)
    except (OSError, httptools.HttpParserError) as e:  # refused, reset, timed out, garbled
        return Sample(False, time.perf_counter() - start, error=type(e).__name__)
    e2e = time.perf_counter() - start
    if status != 200:
        return Sample(False, e2e, error=f"http {status}")
    events.finish()
    if events.error is not None:
        return Sample(False, e2e, error=events.error)
    ttft = events.ttft if events.ttft is not None else e2e
    return Sample(True, e2e, ttft, events.usage if events.usage is not None else events.chunks,
                  itl=events.itl)
