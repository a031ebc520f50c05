"""Fan-out of one HTTP request into engine requests, and Server-Sent Events framing.

An HTTP request with `n` choices over `P` prompts becomes `P * n` engine requests, choice index
`p * n + i` (prompt-major, like OpenAI). They are started together and *primed* (first delta
awaited) before any HTTP status is sent: the engine raises bad-request errors before its first
yield, so a streamed request still gets a proper 4xx instead of a 200 with an error inside.
Closing a stream closes every engine iterator, which aborts those requests in the engine.
"""
from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from loraserve.engine.types import GenerateRequest, RequestOutput

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass(slots=True)
class PrimedStream:
    """An engine output iterator whose first delta has already been received."""

    iterator: AsyncIterator[RequestOutput]
    first: RequestOutput | None  # None: the engine finished without yielding


async def _open(engine: Any, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
    it = engine.generate(request)
    return await it if inspect.isawaitable(it) else it


async def _first(it: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def close_all(iterators: Sequence[AsyncIterator[RequestOutput]]) -> None:
    """Close engine iterators (aborting their requests), even inside a cancelled scope."""
    with anyio.CancelScope(shield=True):
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # still running in a task being cancelled; it ends itself
                    pass


async def start_all(engine: Any, requests: Sequence[GenerateRequest]) -> list[PrimedStream]:
    """Submit `requests` and await each first delta; on any error close all and re-raise it."""
    iterators: list[AsyncIterator[RequestOutput]] = []
    try:
        for request in requests:
            iterators.append(await _open(engine, request))
        firsts = await asyncio.gather(*(_first(it) for it in iterators), return_exceptions=True)
    except BaseException:
        await close_all(iterators)
        raise
    errors = [f for f in firsts if isinstance(f, BaseException)]
    if errors:
        await close_all(iterators)
        raise errors[0]
    return [PrimedStream(it, first)  # type: ignore[arg-type]
            for it, first in zip(iterators, firsts)]


async def merge(streams: Sequence[PrimedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, delta) pairs from all streams as they arrive; a stream's error re-raises.

    Closing this generator (client gone) cancels the pumps and closes every engine iterator.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: PrimedStream) -> None:
        try:
            if stream.first is not None:
                await queue.put((index, stream.first, None))
                async for out in stream.iterator:
                    await queue.put((index, out, None))
            await queue.put((index, None, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
                continue
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        await close_all([s.iterator for s in streams])
