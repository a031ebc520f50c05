"""Every user-supplied grammar parsed off the event loop, under a deadline and a per-tenant budget.

A request's structured output (`response_format`, `guided_*`, `structured_outputs`) and a forced
tool call's grammar (its functions' parameter schemas) are turned into xgrammar grammars before
the request is queued. That conversion is user-controlled work: a 450-deep nested schema took
10 s of xgrammar, and on the event loop it froze `/health` and every tenant. So it runs here:

- in **worker processes** (`workers`, forked from a forkserver that has imported xgrammar once),
  never on the event loop nor on a thread of the API process; a worker past the deadline is
  killed (SIGKILL), which ends its CPU use too, and replaced;
- under a **deadline** (`deadline_s`, counted from when a worker takes the job): past it, a 400
  naming the field and the limit; the key is remembered as failing, so a client resending the
  same schema costs nothing more;
- within a **per-tenant budget**: at most `per_tenant` grammars of one tenant in flight (queued or
  running), a 429 beyond; a free worker goes to the waiting tenant with the fewest jobs running,
  so one tenant's pathological schemas hold at most its share of the workers;
- a grammar that passed is remembered by (kind, text) (a bounded LRU): the same schema again is
  answered without a worker; concurrent requests with one grammar share one conversion (and
  count once against the budget).

`GrammarChecks.settle(spec, tenant)` returns the spec the engine gets: the request's own, or for
a forced tool call (kind `tool_call`, made by `tool_calls.plan_tools(..., defer=True)`) the EBNF
grammar built from its functions. Costs: bench/RESULTS.md, "Grammar containment".
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from loraserve.catalog.lru import BoundedLRU
from loraserve.engine.types import EngineError, GrammarSpec
from loraserve.server.errors import APIError
from loraserve.server.tool_calls import TOOL_CALL

log = logging.getLogger(__name__)

WORKERS = 2
DEADLINE_S = 5.0  # a grammar that does not convert within this, once a worker runs it: 400
PER_TENANT = 4  # grammars of one tenant in flight (queued or running); more: 429
WAIT_S = 60.0  # the longest a grammar waits for a worker (workers starting, all busy): then 503
WORKER_MODULE = "loraserve.server.grammar_worker"


def _context():
    """The forkserver context, its server preloading xgrammar: a new worker is a fork of a
    process that has imported it (~ms), not a fresh interpreter importing it (~3-6 s)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([WORKER_MODULE])
    return ctx


@dataclass(slots=True)
class _Worker:
    proc: Any  # multiprocessing.Process
    conn: Any  # its end of the pipe

    def kill(self) -> None:
        try:
            self.proc.kill()
        except (OSError, ValueError, AttributeError):
            pass
        self.conn.close()


@dataclass(slots=True)
class _Waiter:
    tenant: str
    future: asyncio.Future = field(repr=False)


class GrammarChecks:
    """The grammar workers of one API process (module doc). Event loop only, but `start` and
    `close`, which any thread may call."""

    def __init__(self, workers: int = WORKERS, deadline_s: float = DEADLINE_S,
                 per_tenant: int = PER_TENANT, cache_size: int = 256) -> None:
        self.size, self.deadline_s, self.per_tenant = workers, deadline_s, per_tenant
        self.passed: BoundedLRU[tuple[str, str], str] = BoundedLRU(cache_size)  # key -> EBNF/text
        # key -> (message, the field it names) of a grammar that failed
        self.failed: BoundedLRU[tuple[str, str], tuple[str, str]] = BoundedLRU(cache_size)
        self.killed = 0  # workers killed at the deadline (a metric's source)
        self._idle: list[_Worker] = []
        self._waiting: deque[_Waiter] = deque()
        self._running: dict[str, int] = {}
        self._inflight: dict[str, int] = {}  # tenant -> its grammars in flight
        self._flights: dict[tuple[str, str], asyncio.Future] = {}  # key -> its conversion
        self._lock = threading.Lock()  # guards _idle while start() fills it from a thread
        self._started: threading.Thread | None = None
        self._closed = False

    # -- workers -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers on a thread of their own (the forkserver's first start imports
        xgrammar: seconds that no request or event loop waits for)."""
        if self._started is None:
            self._started = threading.Thread(target=self._fill, name="loraserve-grammar-start",
                                             daemon=True)
            self._started.start()

    def _fill(self) -> None:
        for _ in range(self.size):
            self._start_one()

    def _start_one(self) -> None:
        try:
            self._add(self._spawn())
        except Exception:  # noqa: BLE001 - requests waiting for a worker end with a 503
            log.exception("a grammar worker could not be started")

    def _spawn(self) -> _Worker:
        from loraserve.server import grammar_worker
        ctx = _context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=grammar_worker.serve, args=(child,), daemon=True,
                           name="loraserve-grammar")
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _add(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch)

    def _dispatch(self) -> None:
        """Event loop: hand idle workers to waiters, the tenant with the fewest running first;
        no tenant runs on more than `workers - 1` of them (one stays for the others)."""
        cap = max(1, self.size - 1)
        while True:
            live = [w for w in self._waiting if not w.future.done()]
            self._waiting = deque(live)
            ready = [w for w in live if self._running.get(w.tenant, 0) < cap]
            with self._lock:
                if not ready or not self._idle:
                    return
                worker = self._idle.pop()
            chosen = min(ready, key=lambda w: self._running.get(w.tenant, 0))
            self._waiting.remove(chosen)
            self._running[chosen.tenant] = self._running.get(chosen.tenant, 0) + 1
            chosen.future.set_result(worker)

    async def _take(self, tenant: str) -> _Worker:
        self._loop = asyncio.get_running_loop()
        self.start()
        future = self._loop.create_future()
        self._waiting.append(_Waiter(tenant, future))
        self._dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(future), WAIT_S)
        except asyncio.TimeoutError:
            if future.done():
                return future.result()
            future.cancel()
            raise EngineError(f"no grammar worker was free within {WAIT_S:g} s; retry later",
                              status=503, code="grammar_unavailable") from None
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._ran(tenant)
                self._give_back(future.result())
            else:
                future.cancel()
            raise

    def _ran(self, tenant: str) -> None:
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
        self._dispatch()

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start another on a thread (never on the event loop)."""
        worker.kill()
        self.killed += 1
        threading.Thread(target=self._start_one, daemon=True,
                         name="loraserve-grammar-start").start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    # -- requests ----------------------------------------------------------------------------

    async def settle(self, spec: GrammarSpec, tenant: str) -> GrammarSpec:
        """The spec the engine gets for `spec` (module doc): EngineError 400 naming its field
        when it does not parse or not within the deadline, APIError 429 past the tenant's
        budget, 503 when the workers cannot run."""
        out_kind = "grammar" if spec.kind == TOOL_CALL else spec.kind
        done = self.passed.get(spec.key)
        if done is not None:
            return GrammarSpec(out_kind, done, spec.param)
        failed = self.failed.get(spec.key)
        if failed is not None:
            raise EngineError(failed[0], param=failed[1])
        flight = self._flights.get(spec.key)
        if flight is None:  # one conversion per grammar, however many requests carry it
            if self._inflight.get(tenant, 0) >= self.per_tenant:
                raise APIError(429, f"{spec.param}: {self.per_tenant} grammars of this tenant are "
                               "being checked; retry when one is done", code="rate_limit_exceeded",
                               param=spec.param)
            flight = self._flights[spec.key] = asyncio.ensure_future(self._flight(spec, tenant))
            flight.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if no one waits
        try:
            text = await asyncio.shield(flight)
        except EngineError as exc:  # each request's own
            raise EngineError(str(exc), status=exc.status, code=exc.code,
                              param=exc.param) from None
        return GrammarSpec(out_kind, text, spec.param)

    async def _flight(self, spec: GrammarSpec, tenant: str) -> str:
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        try:
            text = await self._run(spec, tenant)
            self.passed.put(spec.key, text)
            return text
        finally:
            del self._flights[spec.key]
            self._inflight[tenant] -= 1
            if not self._inflight[tenant]:
                del self._inflight[tenant]

    async def _run(self, spec: GrammarSpec, tenant: str) -> str:
        worker = await self._take(tenant)  # counted in _running by _dispatch
        try:
            answer = await asyncio.wait_for(self._ask(worker, spec), self.deadline_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            self._replace(worker)
            if isinstance(exc, asyncio.CancelledError):
                raise
            message = (f"{spec.param}: the grammar did not convert within {self.deadline_s:g} s "
                       "(the server's limit on a grammar's conversion); simplify it")
            self.failed.put(spec.key, (message, spec.param))
            raise EngineError(message, param=spec.param) from None
        except (EOFError, OSError):  # the parser crashed on it (a stack overflow in xgrammar)
            self._replace(worker)
            message = f"{spec.param}: the grammar could not be parsed (its parser process ended)"
            self.failed.put(spec.key, (message, spec.param))  # not sent to a worker again
            raise EngineError(message, param=spec.param) from None
        finally:
            self._ran(tenant)
            self._dispatch()
        self._give_back(worker)
        ok, value, param = answer
        if not ok:
            self.failed.put(spec.key, (value, param))
            raise EngineError(value, param=param)
        return value

    @staticmethod
    async def _ask(worker: _Worker, spec: GrammarSpec) -> tuple[bool, str, str]:
        """Send one job and wait for its answer without blocking the loop (a reader on the pipe)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        fd = worker.conn.fileno()

        def readable() -> None:
            loop.remove_reader(fd)
            if answer.done():
                return
            try:
                answer.set_result(worker.conn.recv())
            except (EOFError, OSError) as exc:
                answer.set_exception(exc)

        worker.conn.send(tuple(spec))
        loop.add_reader(fd, readable)
        try:
            return await answer
        finally:
            loop.remove_reader(fd)


def tenant_of(resolved: Any, principal: Any) -> str:
    """Whose budget a request's grammar counts against: its adapter's tenant, else the key's."""
    return resolved.tenant or getattr(principal, "home_tenant", None) or ""

