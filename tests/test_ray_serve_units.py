"""The scale-out pieces that need no Ray cluster: command-line options, the replica board, and
the ingress facade's stream handling (retry before the first output, clean 503 after it)
against a stand-in deployment handle. Without Ray installed, the facade tests skip."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest

from loraserve.cli import build_parser
from loraserve.engine.config import EngineConfig
from loraserve.engine.messages import Unload, decode
from loraserve.engine.snapshot import EngineSnapshot
from loraserve.engine.types import EngineError, GenerateRequest, RequestOutput, SamplingParams
from loraserve.engine.wire import error_to_wire, output_to_wire
from loraserve.ray_serve.board import ReplicaBoard, merged, nearest
from loraserve.ray_serve.config import ScaleOutConfig, from_args


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_scale_out_options() -> None:
    assert from_args(_serve_args()) is None
    scale = from_args(_serve_args("--replicas", "3", "--ray-num-cpus", "4", "--port", "9000"))
    assert (scale.replicas, scale.num_cpus, scale.port, scale.host) == (3, 4, 9000, "127.0.0.1")
    assert from_args(_serve_args("--replicas", "2", "--ray-object-store-mb", "128")).object_store_mb == 128
    for argv, message in [(["--replicas", "1"], ">= 2"),
                          (["--replicas", "2", "--ray-address", "auto", "--ray-object-store-mb",
                            "128"], "local Ray"),
                          (["--ray-address", "auto"], "needs --replicas"),
                          (["--replicas", "2", "--single-process"], "exclude"),
                          (["--replicas", "2", "--ray-address", "auto", "--ray-num-cpus", "2"],
                           "local Ray")]:
        with pytest.raises(ValueError, match=message):
            from_args(_serve_args(*argv))


def test_replica_gpus_follow_the_engine_device() -> None:
    scale = ScaleOutConfig(replicas=2)
    assert scale.gpus_per_replica(EngineConfig(model_dir="m", device="cuda")) == 1.0
    assert scale.gpus_per_replica(EngineConfig(model_dir="m", device="cpu")) == 0.0
    assert ScaleOutConfig(replicas=2, replica_gpus=0.5).gpus_per_replica(
        EngineConfig(model_dir="m", device="cuda")) == 0.5


def test_plain_serve_never_imports_ray() -> None:
    probe = ("import sys; from loraserve.cli import build_parser; "
             "from loraserve.ray_serve.config import from_args; import loraserve.server.app; "
             "from_args(build_parser().parse_args(['serve'])); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- the replica board --------------------------------------------------------------------------

def test_board_keeps_fresh_snapshots_and_forgets_silent_replicas(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("loraserve.ray_serve.board.time.monotonic", lambda: clock[0])
    board = ReplicaBoard(stale_after_s=5.0)
    board.report("a", EngineSnapshot(running=1), 0, {})
    board.report("b", EngineSnapshot(running=2, waiting_adapters=("t/x@r2",)), 0, {})
    assert set(board.live()) == {"a", "b"}
    clock[0] += 4
    board.report("a", EngineSnapshot(running=3), 0, {})
    clock[0] += 2
    assert set(board.live()) == {"a"} and board.lost == 1


def test_board_broadcast_waits_for_every_live_replica() -> None:
    async def scenario():
        board = ReplicaBoard(stale_after_s=5.0)
        board.report("a", EngineSnapshot(), 0, {})
        board.report("b", EngineSnapshot(), 0, {})
        call = asyncio.ensure_future(board.broadcast(Unload(0, "t/x"), timeout_s=5))
        await asyncio.sleep(0)
        [[seq, wire]] = board.report("a", EngineSnapshot(), 0, {})
        assert decode(wire) == Unload(0, "t/x")  # the call itself, for the replica's core
        assert board.report("a", EngineSnapshot(), seq, {seq: ["ok", 2]}) == []
        assert not call.done()
        board.report("b", EngineSnapshot(), 0, {seq: ["ok", 1]})
        return await call

    assert asyncio.run(scenario()) == {"a": 2, "b": 1}


def test_board_broadcast_raises_a_replica_error() -> None:
    async def scenario():
        board = ReplicaBoard()
        board.report("a", EngineSnapshot(), 0, {})
        call = asyncio.ensure_future(board.broadcast(Unload(0, "t/x"), timeout_s=5))
        await asyncio.sleep(0)
        err = error_to_wire(EngineError("nope", status=404, code="not_found"))
        board.report("a", EngineSnapshot(), 1, {1: ["error", err]})
        return await call

    with pytest.raises(EngineError, match="nope") as info:
        asyncio.run(scenario())
    assert info.value.status == 404


def test_residency_behind_ray_is_the_nearest_any_core_answers() -> None:
    """Every replica's core answers a Residency call live; the ingress answers, per revision,
    the one nearest the device: quarantined on any, else gpu, else cpu, else disk."""
    assert nearest([["disk", "cpu", "gpu", "disk"],
                    ["cpu", "gpu", "quarantined", "disk"]]) == ["cpu", "gpu", "quarantined", "disk"]


def test_merged_snapshot_sums_and_unites() -> None:
    snap = merged([EngineSnapshot(running=1, waiting=2, kv_usage=0.2, running_adapters=("t/a",),
                                  resident=frozenset({("t/a", "r1")}), max_lora=2),
                   EngineSnapshot(running=3, kv_usage=0.4, running_adapters=("t/b@r2",),
                                  resident=frozenset({("t/b", "r2")}), max_lora=2)])
    assert (snap.running, snap.waiting, snap.max_lora) == (4, 2, 4)
    assert snap.kv_usage == pytest.approx(0.3)
    assert snap.running_adapters == ("t/a", "t/b@r2") and snap.resident_ids() == ["t/a", "t/b"]
    assert merged([]) == EngineSnapshot()


# -- the ingress facade's streams ---------------------------------------------------------------

class FakeStream:
    """What `handle.generate.remote()` returns: items, then maybe an exception; with `more`,
    a replica still generating after them (the next item never comes)."""

    def __init__(self, items: list, error: BaseException | None = None, more: bool = False):
        self.items, self.error, self.more, self.cancelled = list(items), error, more, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        if self.more:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, streams: list[FakeStream]):
        self.streams, self.calls = streams, []
        self.generate = SimpleNamespace(remote=self._remote)

    def options(self, **kw):
        self.calls.append(kw)
        return self

    def _remote(self, wire: dict) -> FakeStream:
        return self.streams.pop(0)


def _delta(text: str, finish: str | None = None) -> list:
    return ["out", output_to_wire(RequestOutput("r-1", [1], text, finish_reason=finish))]


@pytest.fixture()
def frontend_for(demo_dense):
    pytest.importorskip("ray")
    from loraserve.engine.client.frontend import EngineClient
    from loraserve.ray_serve.frontend import RayTransport

    def make(streams: list[FakeStream]):
        front = EngineClient(RayTransport(EngineConfig(model_dir=str(demo_dense)), FakeHandle(streams),
                                          ScaleOutConfig(replicas=2)))
        front.transport._started = True
        return front

    return make


async def _collect(front, served: set[str] | None = None) -> list[str]:
    from loraserve.ray_serve.frontend import served_by

    served_by.set(served)
    req = GenerateRequest("r-1", [1, 2], SamplingParams(max_tokens=2))
    return [out.text async for out in front.generate(req)]


def test_a_replica_lost_before_the_first_output_is_retried(frontend_for) -> None:
    from ray.exceptions import ActorDiedError

    first = FakeStream([["replica", "a"]], ActorDiedError())
    second = FakeStream([["replica", "b"], _delta("x"), _delta("y", "stop")])
    front = frontend_for([first, second])
    served: set[str] = set()
    assert asyncio.run(_collect(front, served)) == ["x", "y"]
    assert first.cancelled and not second.cancelled
    assert served == {"b"}  # the lost replica answered nothing
    assert front.transport.replicas.calls[0] == {"stream": True, "multiplexed_model_id": ""}


def test_a_replica_lost_mid_stream_is_one_clean_503(frontend_for) -> None:
    from ray.exceptions import ActorDiedError

    front = frontend_for([FakeStream([["replica", "a"], _delta("x")], ActorDiedError())])
    with pytest.raises(EngineError) as info:
        asyncio.run(_collect(front))
    assert (info.value.status, info.value.code) == (503, "engine_unavailable")


def test_errors_from_the_replica_keep_their_status(frontend_for) -> None:
    err = error_to_wire(EngineError("too long", status=400, param="max_tokens"))
    front = frontend_for([FakeStream([["replica", "a"], ["error", err]])])
    with pytest.raises(EngineError) as info:
        asyncio.run(_collect(front))
    assert (info.value.status, info.value.param) == (400, "max_tokens")


def test_a_full_deployment_is_a_429(frontend_for) -> None:
    from ray.serve.exceptions import BackPressureError

    front = frontend_for([FakeStream([], BackPressureError(num_queued_requests=8, max_queued_requests=8))])
    with pytest.raises(EngineError) as info:
        asyncio.run(_collect(front))
    assert info.value.status == 429


def test_closing_a_stream_early_cancels_the_replica_call(frontend_for) -> None:
    stream = FakeStream([["replica", "a"], _delta("x"), _delta("y")], more=True)
    front = frontend_for([stream])

    async def first_only():
        it = front.generate(GenerateRequest("r-1", [1, 2], SamplingParams(max_tokens=2)))
        out = await it.__anext__()
        await it.aclose()
        return out.text

    assert asyncio.run(first_only()) == "x" and stream.cancelled


# -- shutdown: the ingress's drain, signals, the head watch, what is left behind -----------------

def _drain_app(deadline, drain):
    """A Starlette app behind DrainGate: /slow waits (under the shutdown deadline) for `gate`."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from loraserve.ray_serve.drain import DrainGate
    from loraserve.server.errors import APIError

    gate = asyncio.Event()

    async def slow(request):
        try:
            await deadline.run(gate.wait())
        except APIError as exc:
            return exc.response()
        return JSONResponse({"ok": True})

    async def plain(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/slow", slow), Route("/health", plain), Route("/v1/models", plain)])
    return DrainGate(app, drain), gate


def _drain_scenario(action: str, timeout_s: float):
    """One request in flight, then a drain; `action`: the request finishes, the drain is hurried,
    or nothing (its deadline passes)."""
    import httpx

    from loraserve.ray_serve.drain import Drain
    from loraserve.server.streaming import ShutdownDeadline

    async def scenario():
        deadline = ShutdownDeadline()
        drain = Drain(deadline)
        app, gate = _drain_app(deadline, drain)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://x") as c:
            slow = asyncio.ensure_future(c.get("/slow"))
            while drain.in_flight < 1:
                await asyncio.sleep(0.01)
            assert (await c.get("/v1/models")).status_code == 200  # not draining yet
            running = asyncio.ensure_future(drain.run(timeout_s, flush_s=2.0))
            await asyncio.sleep(0.05)
            assert deadline.draining and drain.draining
            refused = await c.get("/v1/models")
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert (await c.get("/health")).status_code == 200
            if action == "hurry":
                drain.hurry()
            elif action == "finish":
                gate.set()
            report, answer = await running, await slow
        return report, answer

    return asyncio.run(scenario())


def test_a_drain_lets_the_requests_in_flight_finish_and_turns_new_ones_away() -> None:
    report, answer = _drain_scenario("finish", timeout_s=30)
    assert answer.status_code == 200
    assert (report.finished, report.cut, report.left, report.hurried) == (1, 0, 0, False)
    assert report.seconds < 10


def test_a_drain_past_its_deadline_or_hurried_ends_what_is_left_cleanly() -> None:
    for action, timeout_s in (("hurry", 30), ("none", 0.2)):
        report, answer = _drain_scenario(action, timeout_s=timeout_s)
        assert answer.status_code == 503, (action, answer.text)
        assert answer.json()["error"]["code"] == "server_shutting_down"
        assert (report.finished, report.cut, report.left) == (0, 1, 0)
        assert report.hurried == (action == "hurry")
        assert report.seconds < 10


def test_stop_signals_drain_then_hurry_then_give_up() -> None:
    import signal

    from loraserve.ray_serve.shutdown import StopSignals

    signals = StopSignals()
    signals._on_signal(signal.SIGINT, None)  # SIGINT is SIGTERM's twin
    assert signals.first.is_set() and not signals.hurry.is_set()
    signals._on_signal(signal.SIGTERM, None)
    assert signals.hurry.is_set() and not signals.abandon.is_set()
    signals._on_signal(signal.SIGTERM, None)
    signals._on_signal(signal.SIGTERM, None)
    assert signals.abandon.is_set() and signals.names == ["SIGINT", "SIGTERM", "SIGTERM", "SIGTERM"]


def test_the_head_watch_sees_a_local_head_process_go() -> None:
    psutil = pytest.importorskip("psutil")
    from loraserve.ray_serve.shutdown import HeadWatch

    proc = subprocess.Popen(["sleep", "60"])
    try:
        watch = HeadWatch.local({"gcs_server": psutil.Process(proc.pid)})
        assert watch.lost() is None
        proc.kill()
        proc.wait()
        watch._next = 0.0
        assert watch.lost() == f"the local Ray's gcs_server (pid {proc.pid}) exited"
    finally:
        proc.kill()


def test_the_head_watch_gives_a_silent_cluster_its_grace() -> None:
    import time

    from loraserve.ray_serve.shutdown import HeadWatch

    calls = []

    def probe():
        calls.append(1)
        if len(calls) > 1:
            raise TimeoutError("gcs down")

    watch = HeadWatch.remote(probe, grace_s=0.6, every_s=0.05)
    try:
        watch.every_s = 0.0
        assert watch.lost() is None
        deadline = time.monotonic() + 10
        while watch.lost() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "has not answered" in (watch.lost() or "")
    finally:
        watch.close()


def test_bounded_steps() -> None:
    import threading
    import time

    from loraserve.ray_serve.shutdown import bounded

    assert bounded("quick", lambda: None, 5)
    assert not bounded("raises", lambda: 1 / 0, 5)
    hang = threading.Event()
    t0 = time.monotonic()
    assert not bounded("hangs", hang.wait, 0.3)
    assert not bounded("given up", hang.wait, 30, give_up=lambda: True)
    assert time.monotonic() - t0 < 5
    hang.set()


def test_kill_descendants_finds_the_orphans_of_the_tree() -> None:
    """A subreaper's tree: an orphan (its parent exited) is still found, stopped and reaped."""
    pytest.importorskip("psutil")
    probe = ("import subprocess, sys, time, psutil\n"
             "from loraserve.ray_serve.shutdown import become_subreaper, kill_descendants\n"
             "assert become_subreaper()\n"
             "subprocess.run(['sh', '-c', 'sleep 300 & echo $!'], stdout=open('orphan', 'w'))\n"
             "orphan = int(open('orphan').read())\n"
             "time.sleep(0.2)\n"
             "assert psutil.Process(orphan).ppid() == psutil.Process().pid\n"
             "stopped = kill_descendants(term_wait_s=2)\n"
             "assert stopped == [f'sleep {orphan}'], stopped\n"
             "assert not psutil.pid_exists(orphan) and not psutil.Process().children()\n"
             "print('ok')\n")
    import tempfile
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=60, cwd=cwd)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- the engine deployment's request router (router.AffinityRouter), no cluster ----------------

def test_routing_options() -> None:
    scale = from_args(_serve_args("--replicas", "2"))
    assert (scale.routing, scale.load_bound_c) == ("affinity", 1.25)
    scale = from_args(_serve_args("--replicas", "2", "--replica-routing", "multiplex",
                                  "--load-bound", "1.5"))
    assert (scale.routing, scale.load_bound_c) == ("multiplex", 1.5)
    for argv, message in [(["--replica-routing", "multiplex"], "needs --replicas"),
                          (["--replicas", "2", "--load-bound", "0.5"], ">= 1")]:
        with pytest.raises(ValueError, match=message):
            from_args(_serve_args(*argv))


def _router_and_replicas(names: list[str], c: float = 1.25, slots: int = 2):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
    from loraserve.ray_serve.router import AffinityRouter
    dep = DeploymentID(name="LoraServeEngine", app_name="loraserve")
    router = AffinityRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(c=c, slots=slots)
    return router, [SimpleNamespace(replica_id=ReplicaID(n, dep)) for n in names]


def _choose(router, replicas, model_id: str) -> list[str]:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    async def choose():  # a PendingRequest's future needs a running loop
        pr = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(
            request_id="r", internal_request_id="r", multiplexed_model_id=model_id))
        return pr, await router.choose_replicas(replicas, pr)

    pr, ranks = asyncio.run(choose())
    assert pr.routing_context.should_backoff  # every rank offered: Serve backs off before asking again
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0].replica_id.unique_id for rank in ranks]


def test_the_router_ranks_replicas_in_the_adapters_rendezvous_order() -> None:
    from loraserve.ray_serve.routing import preference
    router, reps = _router_and_replicas(["rep-a", "rep-b", "rep-c"])
    for key in ("t/one", "t/two", "t/three"):
        assert _choose(router, reps, key) == preference(key, ["rep-a", "rep-b", "rep-c"])


def test_the_router_spills_past_the_bound_and_counts_completions() -> None:
    from loraserve.ray_serve.routing import in_flight, preference
    router, reps = _router_and_replicas(["rep-a", "rep-b"], c=1.0)
    first, second = preference("t/hot", ["rep-a", "rep-b"])
    by_name = {r.replica_id.unique_id: r.replica_id for r in reps}
    router.on_send_request(by_name[first])   # one in flight on the first choice; bound = 1
    assert in_flight().get(first) == 1       # what /metrics shows (loraserve_router_in_flight)
    assert _choose(router, reps, "t/hot") == [second, first]
    router.on_request_completed(by_name[first], "r")
    assert _choose(router, reps, "t/hot") == [first, second]
    router.on_request_completed(by_name[first], "r")  # a completion never sent: no negative load
    assert router.in_flight[by_name[first]] == 0


def test_the_router_keeps_an_adapter_on_the_replica_holding_it() -> None:
    """A generation accepted by a replica puts its adapter in that replica's pool (the router's
    model): the adapter's next requests go there first, even off its first choice and with
    more in flight there; a warm call pages nothing in; a dead replica holds nothing."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest
    from loraserve.ray_serve.routing import preference
    router, reps = _router_and_replicas(["rep-a", "rep-b"])
    first, second = preference("t/x", ["rep-a", "rep-b"])
    by_name = {r.replica_id.unique_id: r.replica_id for r in reps}

    def routed(call_method: str, replica: str) -> None:
        async def make():
            return PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(
                request_id="r", internal_request_id="r", multiplexed_model_id="t/x",
                call_method=call_method))
        router.on_request_routed(asyncio.run(make()), by_name[replica], None)

    routed("warm", second)
    assert _choose(router, reps, "t/x") == [first, second]
    routed("generate", second)
    router.on_send_request(by_name[second])
    assert _choose(router, reps, "t/x") == [second, first]
    router.on_replica_actor_died(by_name[second])
    assert _choose(router, reps, "t/x") == [first, second]


def test_the_router_sends_base_only_calls_to_the_least_loaded() -> None:
    router, reps = _router_and_replicas(["rep-a", "rep-b"])
    router.on_send_request(reps[0].replica_id)
    assert _choose(router, reps, "") == ["rep-b", "rep-a"]


def test_router_replicas_shows_what_the_router_routes_to() -> None:
    """`routing.routable` (/metrics' loraserve_router_replicas): the replicas Serve last told the
    router of, not those that report to the ingress (a new one reports a moment earlier)."""
    from loraserve.ray_serve.routing import routable
    router, reps = _router_and_replicas(["rep-a", "rep-b"])
    for r in reps:  # what Serve's RunningReplica has that update_replicas reads
        r.multiplexed_model_ids, r.max_ongoing_requests = set(), 5
    seen = []

    async def update():  # Serve calls it on the router's loop
        for live in (reps, reps[1:]):  # both, then rep-a replaced
            router.update_replicas(live)
            seen.append(routable())

    assert not {"rep-a", "rep-b"} & routable()
    asyncio.run(update())
    assert {"rep-a", "rep-b"} <= seen[0]
    assert "rep-a" not in seen[1] and "rep-b" in seen[1]
