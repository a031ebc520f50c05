"""The engine core in its own process (`CoreClient` + `loraserve.engine.core.process`).

Outputs equal the in-process engine's; the core killed under load ends each request in flight
with one clean 503 and no torn connection, a new core starts, and new requests succeed. The
supervisor: a stopped core is found out by its heartbeat and replaced after the engine timeout; a
core killed again and again is restarted with backoff, with no request needed; seeded chaos
(kills, stops, continues) never leaves a request hanging or torn.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from loraserve.demo import build_demo
from loraserve.engine.async_engine import AsyncEngine
from loraserve.engine.config import EngineConfig
from loraserve.engine.client.core_client import Backoff, CoreClient
from loraserve.engine.types import EngineError, GenerateRequest, SamplingParams
from loraserve.server import build_app
from loraserve.tokenizer import Tokenizer

from server.live import LiveServer

ADAPTERS = ["demo/pirate", None, "demo/poet", "demo/robot", "demo/pirate"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> EngineConfig:
    demo = build_demo(tmp_path_factory.mktemp("core") / "demo")
    return EngineConfig(model_dir=str(demo.qwen3), catalog_dir=str(demo.catalog), device="cpu",
                        max_model_len=128, max_batch_size=8, torch_threads=1)


def _requests(tag: str, max_tokens: int) -> list[GenerateRequest]:
    return [GenerateRequest(f"{tag}{i}", [1 + i, 2, 3, 4], SamplingParams(
        max_tokens=max_tokens, temperature=0.7 if i % 2 else 0.0, seed=i, logprobs=2, ignore_eos=True),
        adapter)
        for i, adapter in enumerate(ADAPTERS)]


async def _collect(engine, req: GenerateRequest):
    tokens, logprobs = [], []
    async for out in engine.generate(req):
        tokens += out.token_ids
        logprobs += [(lp.token_id, lp.logprob) for lp in out.logprobs or []]
    return tokens, logprobs


async def _run_all(engine, reqs):
    try:
        return await asyncio.gather(*(_collect(engine, r) for r in reqs))
    finally:
        await engine.shutdown()


def test_core_process_matches_in_process_engine(cfg) -> None:
    local = asyncio.run(_run_all(AsyncEngine.from_config(cfg), _requests("a", 12)))
    remote = asyncio.run(_run_all(CoreClient(cfg), _requests("a", 12)))
    # the same tokens; logprobs equal up to float noise (batches may group differently in time)
    assert [toks for toks, _ in remote] == [toks for toks, _ in local]
    for (_, lr), (_, ll) in zip(remote, local):
        assert [t for t, _ in lr] == [t for t, _ in ll]
        assert max(abs(a - b) for (_, a), (_, b) in zip(lr, ll)) < 1e-4
    assert all(len(toks) == 12 for toks, _ in remote)


async def _kill_under_load(cfg) -> tuple[list, list, int]:
    client = CoreClient(cfg)
    try:
        await client.start()
        first_pid = client.core_pid
        tasks = [asyncio.ensure_future(_collect(client, r)) for r in _requests("k", 100)]
        # all of them are in the engine (sent in one batch), some running: the scheduler need
        # not run all five at once
        while client.snapshot.running < 2:
            await asyncio.sleep(0.01)
        os.kill(first_pid, signal.SIGKILL)
        during = await asyncio.gather(*tasks, return_exceptions=True)
        while not client.ready or client.core_pid == first_pid:
            await asyncio.sleep(0.05)
        after = await asyncio.gather(*(_collect(client, r) for r in _requests("n", 4)))
        return during, after, client.restarts
    finally:
        await client.shutdown()


def test_core_killed_under_load_fails_in_flight_cleanly_then_serves(cfg) -> None:
    during, after, restarts = asyncio.run(_kill_under_load(cfg))
    assert restarts == 1
    assert all(isinstance(e, EngineError) and e.status == 503 and e.code == "engine_unavailable"
               for e in during), during
    assert all(len(toks) == 4 for toks, _ in after)


def test_http_stream_gets_an_error_event_not_a_torn_connection(cfg) -> None:
    client = CoreClient(cfg)
    app = build_app(client)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.post("/v1/completions", json={"model": "demo/pirate", "prompt": "hi",
                                                  "max_tokens": 2}).status_code == 200
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "demo/poet", "prompt": "hello", "max_tokens": 100, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        os.kill(client.core_pid, signal.SIGKILL)
        t.join(60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["code"] == "engine_unavailable"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # new requests succeed once the new core is up
            r = http.post("/v1/completions", json={"model": "demo/robot", "prompt": "hi", "max_tokens": 2})
            if r.status_code == 200:
                break
            assert r.status_code == 503
            time.sleep(0.2)
        assert r.status_code == 200 and client.restarts == 1
        assert http.get("/ready").status_code == 200
        metrics = http.get("/metrics").text
        assert "loraserve_engine_core_restarts 1.0" in metrics and "loraserve_engine_ready 1.0" in metrics


async def _texts(engine, reqs: list[GenerateRequest]) -> tuple[list, object]:
    """Each request's (text, finish reason, tokens); then, once the engine is idle, its snapshot."""
    async def one(req):
        outs = [out async for out in engine.generate(req)]
        return "".join(o.text for o in outs), outs[-1].finish_reason, [t for o in outs for t in o.token_ids]
    try:
        got = await asyncio.gather(*(one(r) for r in reqs))
        for _ in range(1000):  # the stop string's abort reaches the engine
            if engine.snapshot.running == 0 and engine.snapshot.waiting == 0:
                break
            await asyncio.sleep(0.01)
        return got, engine.snapshot
    finally:
        await engine.shutdown()


def test_core_process_stop_string_and_normal_request_finish_together(cfg) -> None:
    """A stop string, now matched in the API process, ends its request (finish "stop", text cut
    before it) and aborts it in the core; a normal request in the same batches runs to its
    length. Both hostings give the same answers, and the core ends idle with its KV freed."""
    tok = Tokenizer.from_dir(cfg.model_dir)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Who are you?"}]))
    greedy = dict(temperature=0.0, ignore_eos=True)

    def reqs() -> list[GenerateRequest]:
        long = cfg.max_model_len - len(prompt)  # would run to the end of the context without it
        return [GenerateRequest("stop", prompt, SamplingParams(max_tokens=long, stop=["pirate"], **greedy),
                                "demo/pirate"),
                GenerateRequest("free", prompt, SamplingParams(max_tokens=12, **greedy), "demo/robot"),
                GenerateRequest("quiet", prompt, SamplingParams(max_tokens=long, stop=[" be a"], **greedy),
                                "demo/pirate", stream=False)]

    local, _ = asyncio.run(_texts(AsyncEngine.from_config(cfg), reqs()))
    remote, snap = asyncio.run(_texts(CoreClient(cfg), reqs()))
    assert remote == local
    (stop_text, stop_reason, stop_ids), (free_text, free_reason, free_ids), quiet = remote
    assert (stop_text, stop_reason) == ("Arr, I be a ", "stop")
    assert tok.decode(stop_ids).startswith("Arr, I be a pirat")  # up to the token that completed it
    assert (free_text, free_reason, len(free_ids)) == ("Beep boop. I", "length", 12)  # byte tokens
    assert quiet[:2] == ("Arr, I", "stop")
    assert snap.running == 0 and snap.waiting == 0 and snap.kv_usage == 0


# -- supervision: a stopped core, a core killed again and again, chaos ---------------------------

def _zombie_children() -> list[int]:
    """This process's children that have exited and not been reaped."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if int(ppid) == os.getpid() and state == "Z":
            found.append(int(entry))
    return found


def _until(condition, timeout_s: float, what: str, every_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"never happened within {timeout_s} s: {what}")


def _clean_503(r: httpx.Response) -> dict:
    """The OpenAI error of a clean engine_unavailable 503 (with Retry-After)."""
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "engine_unavailable"), error
    assert int(r.headers["Retry-After"]) >= 1
    return error


def test_a_stopped_core_is_found_out_its_requests_end_with_503_and_it_is_replaced(cfg) -> None:
    """SIGSTOP: /ready 503 within seconds (before the engine timeout), new requests 503 at once,
    the requests in flight one clean 503 each after --engine-timeout, then the stopped core is
    killed, reaped and replaced, and requests succeed again."""
    timeout_s = 4.0  # /ready turns 503 after 2 s of silence: well before it
    client = CoreClient(cfg, engine_timeout_s=timeout_s, backoff=Backoff(0.1, 1.0))
    app = build_app(client)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/completions", json={"model": "demo/pirate", "prompt": "hi",
                                                  "max_tokens": 2}).status_code == 200
        result: dict = {}
        started = threading.Event()

        def stream() -> None:
            body = {"model": "demo/poet", "prompt": "hello", "max_tokens": 100, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                result["stream_status"] = r.status_code
                result["events"] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["events"].append(line[6:])
                        started.set()
                result["stream_ended"] = time.monotonic()

        def plain() -> None:
            body = {"model": "qwen3", "prompt": "hello", "max_tokens": 100, "ignore_eos": True}
            result["plain"] = http.post("/v1/completions", json=body)
            result["plain_ended"] = time.monotonic()

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(60)
        _until(lambda: client.snapshot.running >= 2, 30, "both requests running")
        pid = client.core_pid
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            ready = _until(lambda: (r := http.get("/ready")).status_code == 503 and r, 10,
                           "/ready 503")
            noticed_s = time.monotonic() - stopped_at
            assert noticed_s < timeout_s, noticed_s  # within seconds, before the engine timeout
            _clean_503(ready)
            asked = time.monotonic()  # a new request is refused at once, not held
            _clean_503(http.post("/v1/completions", json={"model": "qwen3", "prompt": "x",
                                                          "max_tokens": 2}))
            assert time.monotonic() - asked < 2.0
            for t in threads:
                t.join(30)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        # the in-flight requests: one clean 503 each, at the engine timeout
        plain_s = result["plain_ended"] - stopped_at
        assert timeout_s - 1.0 <= plain_s <= timeout_s + 3.0, plain_s
        _clean_503(result["plain"])
        events = result["events"]
        assert result["stream_status"] == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
        assert all("error" not in json.loads(e) for e in events[:-2])
        assert result["stream_ended"] - stopped_at <= timeout_s + 3.0
        # the stopped core was killed and reaped; a new one serves
        _until(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the stopped core reaped")
        _until(lambda: http.get("/ready").status_code == 200, 60, "a new core ready")
        assert client.core_pid != pid and not _zombie_children()
        r = http.post("/v1/completions", json={"model": "demo/robot", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert client.transport.restart_causes == {"exited": 0, "stalled": 1, "start_failed": 0}
        metrics = http.get("/metrics").text
        assert 'loraserve_engine_restarts_total{cause="stalled"} 1.0' in metrics
        assert "loraserve_engine_up 1.0" in metrics


def test_a_first_core_that_cannot_start_is_reported_not_retried_forever(cfg) -> None:
    """The first core fails to build (no such device): start() (what `serve`'s lifespan awaits)
    raises at once with a 503, nothing is left running or unreaped, and a later start() tries
    again."""
    import dataclasses

    async def run() -> tuple[list, CoreClient]:
        client = CoreClient(dataclasses.replace(cfg, device="cuda:99"), backoff=Backoff(0.1, 0.2))
        errors = []
        try:
            for _ in range(2):
                with pytest.raises(EngineError) as info:
                    await client.start()
                errors.append(info.value)
                assert client.transport.state == "stopped" and client.core_pid is None
        finally:
            await client.shutdown()
        return errors, client

    errors, client = asyncio.run(run())
    assert all(e.status == 503 and e.code == "engine_unavailable" and "exited while starting"
               in str(e) for e in errors), errors
    assert client.restarts == 0 and not _zombie_children()


def test_a_core_killed_again_and_again_is_restarted_with_backoff_without_requests(cfg) -> None:
    """Eight SIGKILLs in a row (most while the new core is still starting): the supervisor starts
    each next core by itself, after growing waits, reaps every dead one, and the server is ready
    again with no request having arrived; then requests succeed."""
    backoff = Backoff(initial=0.1, cap=0.8)
    expected = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8, 0.8]  # after kills 1..7 (the 8th's is the 8th wait)
    client = CoreClient(cfg, backoff=backoff)
    app = build_app(client)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/ready").status_code == 200
        pid, gaps, killed_at = None, [], None
        for _ in range(8):
            new = _until(lambda: client.core_pid not in (None, pid) and client.core_pid, 30,
                         "the supervisor started another core", every_s=0.002)
            if killed_at is not None:
                gaps.append(time.monotonic() - killed_at)
            pid = new
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
        assert http.get("/ready").status_code == 503
        # no request: the supervisor brings a core up by itself
        _until(lambda: http.get("/ready").status_code == 200, 60, "ready again", every_s=0.1)
        assert client.restarts == 8 and sum(client.transport.restart_causes.values()) == 8
        for gap, wait in zip(gaps, expected):
            assert gap >= wait, (gaps, expected)
        # the waits grew to the cap (the gaps add each start's own time, which load stretches
        # unevenly, so the growth is read from the backoff, its floor from the gaps above)
        assert backoff.delay == backoff.cap, (backoff.delay, gaps)
        assert not _zombie_children()
        replies = [None] * 4

        def other_client(i: int) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as own:
                replies[i] = own.post("/v1/completions", json={
                    "model": ADAPTERS[i] or "qwen3", "prompt": "hi", "max_tokens": 3})

        threads = [threading.Thread(target=other_client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None and r.status_code == 200 for r in replies), replies
        metrics = http.get("/metrics").text
        assert "loraserve_engine_core_restarts 8.0" in metrics and "loraserve_engine_up 1.0" in metrics


CHAOS_SEED = int(os.environ.get("LORASERVE_CHAOS_SEED", "22"))
MAX_REQUESTS_PER_CLIENT = 400


def test_chaos_every_request_ends_with_200_or_one_clean_503_and_the_server_recovers(cfg) -> None:
    """Seeded chaos: SIGKILL, SIGSTOP, SIGSTOP then SIGCONT (before or after the engine timeout)
    at random moments while clients keep sending (streamed or not). Every request ends in time
    with a 200 or one clean 503 (a stream: complete, or an error event then [DONE]); no connection
    is dropped and none hangs; afterwards the server is ready and serves. LORASERVE_CHAOS_SEED
    picks another run."""
    import random

    rng = random.Random(CHAOS_SEED)
    timeout_s = 3.0
    client = CoreClient(cfg, engine_timeout_s=timeout_s, backoff=Backoff(0.1, 0.8))
    app = build_app(client)
    outcomes: list[tuple] = []
    failures: list[str] = []
    stop_clients = threading.Event()
    bound_s = timeout_s + 8.0  # the engine timeout, plus a request's own time on a busy machine

    def one(http: httpx.Client, i: int, crng: random.Random) -> None:
        body = {"model": rng_choice(crng), "prompt": "hello", "max_tokens": crng.randint(1, 12),
                "ignore_eos": True}
        stream = crng.random() < 0.5
        began = time.monotonic()
        try:
            if stream:
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    status = r.status_code
                    if status == 200:
                        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
                        assert events[-1] == "[DONE]", events
                        last = json.loads(events[-2])
                        if "error" in last:
                            assert last["error"]["code"] == "engine_unavailable", last
                            kind = "503-event"
                        else:
                            assert last["choices"][0]["finish_reason"] == "length", last
                            kind = "200"
                    else:
                        r.read()
                        _clean_503(r)
                        kind = "503"
            else:
                r = http.post("/v1/completions", json=body)
                if r.status_code == 200:
                    assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
                    kind = "200"
                else:
                    _clean_503(r)
                    kind = "503"
        except Exception as exc:  # a dropped connection, a hang (client timeout), a bad answer
            failures.append(f"request {i} ({'stream' if stream else 'plain'}): {exc!r}")
            return
        took = time.monotonic() - began
        outcomes.append((kind, took))
        if took > bound_s:
            failures.append(f"request {i} took {took:.1f} s")

    def rng_choice(crng: random.Random) -> str:
        return crng.choice(["qwen3", "demo/pirate", "demo/poet", "demo/robot"])

    def client_loop(k: int) -> None:
        crng = random.Random(CHAOS_SEED * 100 + k)
        with httpx.Client(base_url=server.url, timeout=bound_s + 20) as http:
            i = 0
            while not stop_clients.is_set() and i < MAX_REQUESTS_PER_CLIENT:
                one(http, k * 1000 + i, crng)
                i += 1
                time.sleep(crng.uniform(0, 0.2))

    stopped: set[int] = set()
    actions: list[str] = []
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        clients = [threading.Thread(target=client_loop, args=(k,)) for k in range(3)]
        for t in clients:
            t.start()
        try:
            chaos_end = time.monotonic() + 9.0
            while time.monotonic() < chaos_end:
                # mostly hit a core that serves (a new one takes seconds to start), sometimes
                # one still starting
                if rng.random() < 0.8:
                    _until(lambda: client.ready, 60, "a core up for the next blow", every_s=0.05)
                time.sleep(rng.uniform(0.2, 1.2))
                pid = client.core_pid
                action = rng.choice(["kill", "stop", "stop-cont", "stop-cont"])
                if pid is None:
                    continue
                actions.append(action)
                try:
                    if action == "kill":
                        os.kill(pid, signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGSTOP)
                        stopped.add(pid)
                        if action == "stop-cont":  # before or after the engine timeout
                            time.sleep(rng.uniform(0.2, 1.5 * timeout_s))
                            os.kill(pid, signal.SIGCONT)
                            stopped.discard(pid)
                except ProcessLookupError:
                    pass  # it ended meanwhile (killed as stalled)
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            stop_clients.set()
            for t in clients:
                t.join(bound_s + 30)
        kinds = {k for k, _ in outcomes}
        print(f"chaos seed {CHAOS_SEED}: {actions}; outcomes", {k: sum(1 for o, _ in outcomes if o == k)
                                                              for k in sorted(kinds)})
        assert not failures, failures[:5]
        assert outcomes and kinds <= {"200", "503", "503-event"}, kinds
        assert actions  # chaos happened
        _until(lambda: http.get("/ready").status_code == 200, 60, "ready after the chaos", every_s=0.1)
        r = http.post("/v1/completions", json={"model": "demo/pirate", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        assert not _zombie_children()


def test_a_core_that_compiles_gets_longer_to_start(cfg) -> None:
    """The start-up deadline: 300 s, 1800 s where the core may compile its decode step (2.5-4
    minutes at 0.6B shapes on 2 cores), or what `--engine-start-timeout` says."""
    from dataclasses import replace

    from loraserve.cli import build_parser
    from loraserve.engine.client.core_client import COMPILE_START_TIMEOUT_S, START_TIMEOUT_S

    assert CoreClient(replace(cfg, compile="off")).transport.start_timeout_s == START_TIMEOUT_S
    for mode in ("on", "auto"):
        assert CoreClient(replace(cfg, compile=mode)).transport.start_timeout_s == COMPILE_START_TIMEOUT_S
    assert CoreClient(replace(cfg, compile="on"), start_timeout_s=42.0).transport.start_timeout_s == 42.0
    args = build_parser().parse_args(["serve", "--model", "m", "--engine-start-timeout", "42"])
    assert args.engine_start_timeout == 42.0
    assert build_parser().parse_args(["serve", "--model", "m"]).engine_start_timeout is None
