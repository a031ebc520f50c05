"""Fan-out of one HTTP request into engine requests, and Server-Sent Events framing.

An HTTP request with `n` choices over `P` prompts becomes `P * n` engine requests, choice index
`p * n + i` (prompt-major, like OpenAI). They are started together and *primed* (first delta
awaited) before any HTTP status is sent: the engine raises bad-request errors before its first
yield, so a streamed request still gets a proper 4xx instead of a 200 with an error inside.
Closing a stream closes every engine iterator, which aborts those requests in the engine.
A ShutdownDeadline ends whatever is still running when the server's shutdown deadline passes.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from loraserve.engine.types import GenerateRequest, RequestOutput
from loraserve.server.errors import APIError
from loraserve.server.fastjson import dumps

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON."""
    return f"data: {dumps(payload)}\n\n"  # orjson: ~10x cheaper per chunk than json.dumps


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and ended this request at its shutdown "
                    "deadline; retry it", code="server_shutting_down")


class ShutdownDeadline:
    """The server's shutdown deadline, as the requests in flight see it.

    Work registers an `end` callback while it waits on the engine (`watch`); `expire()` (the
    deadline passed) calls every one, and each ends its request with `shutting_down()` (a 503, or
    an error event in a stream already answering). Work that starts after it fails at once.
    """

    def __init__(self) -> None:
        self.passed = False
        self.draining = False  # shutdown has begun (/ready answers 503 from then on)
        self._ends: set[Callable[[], None]] = set()

    @property
    def watched(self) -> int:
        """Requests now waiting on the engine under this deadline."""
        return len(self._ends)

    def expire(self) -> None:
        self.passed = True
        for end in list(self._ends):
            end()

    @contextlib.contextmanager
    def watch(self, end: Callable[[], None]) -> Iterator[None]:
        """Call `end` if the deadline passes while the block runs (at once if it has)."""
        self._ends.add(end)
        try:
            if self.passed:
                end()
            yield
        finally:
            self._ends.discard(end)

    async def run(self, work: Awaitable[T]) -> T:
        """Await `work`; shutting_down() if the deadline passes first (`work` is cancelled).

        `work` runs in the calling task, which the deadline cancels: no task of its own per
        request (bench/RESULTS.md counts the per-request asyncio objects among the hot path's
        largest costs). A cancellation from elsewhere still propagates as it is.
        """
        if self.passed:
            if inspect.iscoroutine(work):
                work.close()
            raise shutting_down()
        task = asyncio.current_task()
        ended = False

        def end() -> None:
            nonlocal ended
            ended = True
            task.cancel()

        with self.watch(end):
            try:
                result = await work
            except asyncio.CancelledError:
                if ended and task.uncancel() == 0:  # ours alone: the deadline passed
                    raise shutting_down() from None
                raise
        if ended:  # the deadline passed as `work` finished, and `work` absorbed the cancel
            task.uncancel()
        return result


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


async def _first_or_error(it: AsyncIterator[RequestOutput]) -> RequestOutput | Exception | None:
    """`_first`, its error returned as gather(return_exceptions=True) would (cancellation raises)."""
    try:
        return await _first(it)
    except Exception as exc:
        return exc


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
        if len(iterators) == 1:  # the common case (one prompt, n=1): awaited here, no task for it
            firsts = [await _first_or_error(iterators[0])]
        else:
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


async def merge(streams: Sequence[PrimedStream], deadline: ShutdownDeadline | None = None,
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, delta) pairs from all streams as they arrive; a stream's error re-raises,
    and so does shutting_down() when `deadline` passes.

    Closing this generator (client gone) cancels the pumps and closes every engine iterator.
    """
    if len(streams) == 1:  # the common case (one prompt, n=1): read in place, see _merge_one
        async for pair in _merge_one(streams[0], deadline):
            yield pair
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()
    watch = contextlib.nullcontext() if deadline is None else \
        deadline.watch(lambda: queue.put_nowait((-1, None, shutting_down())))

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
        with watch:
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


async def _merge_one(stream: PrimedStream, deadline: ShutdownDeadline | None,
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`merge` of one stream without a pump task and queue: two task switches per delta fewer.

    The deadline cancels the reading task only while it waits here for the engine; passing
    while the task is elsewhere (a streamed chunk being written), it ends the stream before the
    next read. Either way the reader gets shutting_down(), as from `merge`.
    """
    task = asyncio.current_task()
    ended = cancelled = reading = False

    def end() -> None:
        nonlocal ended, cancelled
        ended = True
        if reading and not cancelled:
            cancelled = True
            task.cancel()

    watch = contextlib.nullcontext() if deadline is None else deadline.watch(end)
    try:
        with watch:
            if stream.first is None:
                return
            if ended:
                raise shutting_down()
            yield 0, stream.first
            while True:
                if ended:
                    raise shutting_down()
                reading = True
                try:
                    out = await stream.iterator.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if cancelled and task.uncancel() == 0:  # ours alone: the deadline passed
                        raise shutting_down() from None
                    raise
                finally:
                    reading = False
                yield 0, out
    finally:
        await close_all([stream.iterator])
