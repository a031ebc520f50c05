"""A request's work runs in its own task, with no helper tasks: the shutdown deadline and a
client that leaves cancel that task, and only their own cancellation becomes their answer (503 /
shutting_down, 499); any other cancellation still propagates, and the task is left usable."""
from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from loraserve.engine.types import SamplingParams
from loraserve.server.app import CLIENT_CLOSED, _answer
from loraserve.server.errors import APIError
from loraserve.server.serving import Prompt, fan_out
from loraserve.server.streaming import ShutdownDeadline, merge, start_all

from .fake_engine import FakeEngine


def _one(engine: FakeEngine, max_tokens: int = 50):
    return fan_out("t", [Prompt("a", [1])], 1, SamplingParams(max_tokens=max_tokens), None, 1.0)


def _is_shutting_down(exc: BaseException) -> bool:
    return isinstance(exc, APIError) and exc.status == 503 and exc.code == "server_shutting_down"


def test_deadline_run_ends_its_work_in_the_calling_task() -> None:
    async def run() -> tuple[BaseException, int, int]:
        deadline = ShutdownDeadline()
        started = asyncio.Event()

        async def work() -> None:
            started.set()
            await asyncio.sleep(60)

        async def request() -> tuple[BaseException, int]:
            with pytest.raises(APIError) as err:
                await deadline.run(work())
            await asyncio.sleep(0)  # the task is not left cancelled
            return err.value, asyncio.current_task().cancelling()

        task = asyncio.ensure_future(request())
        await started.wait()
        tasks_during = len(asyncio.all_tasks())
        deadline.expire()
        err, cancelling = await task
        return err, cancelling, tasks_during

    err, cancelling, tasks_during = asyncio.run(run())
    assert _is_shutting_down(err) and cancelling == 0
    assert tasks_during == 2  # the test's main task and the request's: no task for `work`


def test_deadline_run_lets_another_cancellation_through() -> None:
    async def run() -> None:
        deadline = ShutdownDeadline()
        task = asyncio.ensure_future(deadline.run(asyncio.sleep(60)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert deadline.watched == 0

    asyncio.run(run())


@pytest.mark.parametrize("where", ["reading", "elsewhere"])
def test_one_stream_merge_ends_at_the_deadline_wherever_its_reader_is(where: str) -> None:
    """The deadline passes while the reader waits on the engine (its task is cancelled there) or
    while it is busy elsewhere (the stream ends before the next read): shutting_down() either
    way, the engine request is aborted, and a wait outside the merge is not cut short."""
    engine = FakeEngine(delay_s=0.02)

    async def run() -> tuple[list, BaseException | None, int, bool]:
        deadline = ShutdownDeadline()
        streams = await start_all(engine, _one(engine))
        got, error, slept = [], None, False
        try:
            async for index, out in merge(streams, deadline):
                got.append(out)
                if len(got) == 2:
                    if where == "reading":
                        asyncio.get_running_loop().call_later(0.005, deadline.expire)
                    else:
                        deadline.expire()
                        await asyncio.sleep(0.05)  # e.g. a chunk being written
                        slept = True
        except APIError as exc:
            error = exc
        return got, error, asyncio.current_task().cancelling(), slept

    got, error, cancelling, slept = asyncio.run(run())
    assert len(got) == 2 and error is not None and _is_shutting_down(error)
    assert cancelling == 0 and slept == (where == "elsewhere")
    assert engine.aborted == ["t-0"] and engine.running == 0


def test_one_stream_merge_reads_without_helper_tasks() -> None:
    engine = FakeEngine(delay_s=0.001)

    async def run() -> tuple[int, int]:
        streams = await start_all(engine, _one(engine, max_tokens=5))
        most = 0
        n = 0
        async for _ in merge(streams, ShutdownDeadline()):
            most = max(most, len(asyncio.all_tasks()))
            n += 1
        return n, most

    n, most = asyncio.run(run())
    assert n >= 2 and most == 1  # the FakeEngine yields per token: several deltas, one task


def _request(messages: list[dict]) -> Request:
    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                   receive)


def test_answer_is_499_when_the_client_leaves_and_the_task_stays_usable() -> None:
    async def run() -> tuple[int, bool, int]:
        cleaned = False

        async def handler():
            nonlocal cleaned
            try:
                await asyncio.sleep(60)
            finally:
                cleaned = True

        response = await _answer(_request([{"type": "http.disconnect"}]), handler())
        await asyncio.sleep(0)
        return response.status_code, cleaned, asyncio.current_task().cancelling()

    assert asyncio.run(run()) == (CLIENT_CLOSED, True, 0)


def test_answer_lets_another_cancellation_through_and_answers_errors() -> None:
    async def run() -> int:
        task = asyncio.ensure_future(_answer(_request([]), asyncio.sleep(60)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def failing():
            raise APIError(404, "no such model")

        response = await _answer(_request([]), failing())
        await asyncio.sleep(0.01)  # the disconnect watch was cancelled, nothing cancels us now
        return response.status_code

    assert asyncio.run(run()) == 404
