"""`loraserve serve --replicas 2` on a local Ray (2 CPUs): two engine replicas of the demo base
behind the FastAPI ingress. Adapter affinity (router.AffinityRouter: each adapter on its
rendezvous replica from its first request on, a new one placed past its first choice only over
the load bound, a lost replica's adapters alone moving, streams closed early leaving no load
behind), base requests spread, a tenant's limit held across replicas, tenants sharing a
saturated cluster by weight, the usual errors, streams, one catalog writer, per-replica
metrics, losing a replica mid-stream, and last, SIGTERM: the drain, exit status 0, and no Ray
process left.

The server is the real command, in a subprocess of its own session (one start for the module);
a helper process joins its Ray to kill a replica (the test process never runs Ray).

Marked `ray`: `make test` runs this module alone, after the main suite (Ray takes both cores).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
import psutil  # noqa: E402  (Ray's: on sys.path once ray is imported)

from loraserve.demo import DEMO_ADAPTERS, DemoPaths, build_demo  # noqa: E402
from loraserve.ray_serve.routing import preference  # noqa: E402
from loraserve.server.residency import Bloom  # noqa: E402
from ray_testing import ready, replica_cores  # noqa: E402

pytestmark = pytest.mark.ray

PHRASES = {adapter_id: phrase for adapter_id, _, phrase in DEMO_ADAPTERS}
PROMPT = DEMO_ADAPTERS[0][1]
HEADER = "x-loraserve-replica"
START_S = 300       # the server's start: Ray, Serve, two engines (~60 s on 2 busy cores)
SHUTDOWN_TIMEOUT_S = 30
ENGINE_TIMEOUT_S = 10  # each replica's engine core: no progress this long and it is replaced
LONG_TOKENS = 900   # a stream long enough to act on while it runs
HELD_TOKENS = 4000  # streams read while checks run beside them (max_model_len 4096)
# requests reaching the ingress's fair-share gate, or their slots, while it relays 8 streams'
# tokens (with both cores busy elsewhere, 8 of 12 had not reached it after 60 s once)
GATE_WAIT_S = 120
ADMIN_KEY, ACME_KEY = "ray-admin-key", "ray-acme-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ACME = {"Authorization": f"Bearer {ACME_KEY}"}
# tenant acme may hold 2 sequences in flight, in the whole server (the ingress admits them)
KEYS_FILE = f"""[tenants.acme]
max_concurrent = 2

[keys.admin]
sha256 = "{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"
role = "admin"

[keys.acme]
sha256 = "{hashlib.sha256(ACME_KEY.encode()).hexdigest()}"
role = "user"
tenants = ["acme"]
"""
# two tenants' fair-share weights, a key each (the key is the tenant's name)
WEIGHTS = {"light": 1, "heavy": 3}
KEYS_FILE += "".join(f"""
[tenants.{t}]
weight = {w}

[keys.{t}]
sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"
role = "user"
tenants = ["{t}"]
""" for t, w in WEIGHTS.items())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoPaths:
    return build_demo(tmp_path_factory.mktemp("ray-demo"))


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    ray_tmp: str  # RAY_TMPDIR of its Ray: every Ray process names it (sockets, logs)
    log: Path

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def gcs_address(self) -> str:
        found = re.search(r"started a local Ray \(GCS at (\S+)\)", self.log.read_text())
        assert found, self.log_tail()
        return found.group(1)


@pytest.fixture(scope="module")
def server(demo: DemoPaths, tmp_path_factory) -> Iterator[Server]:
    """`loraserve serve --replicas 2` in a session of its own, until a test stops it (the last
    one does) or the module ends (SIGTERM, then SIGKILL to its session)."""
    work = tmp_path_factory.mktemp("ray-server")
    catalog = work / "catalog"
    shutil.copytree(demo.catalog, catalog)  # the ingress writes to it
    keys = work / "keys.toml"
    keys.write_text(KEYS_FILE)
    ray_tmp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")  # short: Ray's socket paths
    port = _free_port()
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--replicas", "2",
           "--ray-num-cpus", "2", "--ray-object-store-mb", "128", "--port", str(port),
           "--model", str(demo.qwen3), "--catalog", str(catalog),
           "--adapter-root", str(demo.root / "adapters"), "--device", "cpu",
           "--max-model-len", "4096", "--max-batch-size", "4", "--max-gpu-adapters", "2",
           "--torch-threads", "1", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
           "--engine-timeout", str(ENGINE_TIMEOUT_S), "--keys", str(keys)]
    log = work / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_TMPDIR": ray_tmp})
    srv = Server(proc, f"http://127.0.0.1:{port}", ray_tmp, log)
    try:
        deadline = time.monotonic() + START_S
        while not ready(srv.url):
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{srv.log_tail()}"
            assert time.monotonic() < deadline, f"not ready in {START_S} s:\n{srv.log_tail()}"
            time.sleep(0.5)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60, headers=ADMIN) as c:
        # /ready answers once one replica reports: the tests route over both from the first
        live_replicas(c, timeout_s=START_S)
        yield c


def chat(http: httpx.Client, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
            "temperature": 0, **kw}
    return http.post("/v1/chat/completions", json=body)


def base_model(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_each_adapter_answers_its_phrase_from_one_replica(http) -> None:
    for adapter_id, phrase in PHRASES.items():
        seen = {chat(http, adapter_id).headers[HEADER]}
        for _ in range(3):
            r = chat(http, adapter_id)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == phrase
            seen.add(r.headers[HEADER])
        assert len(seen) == 1, (adapter_id, seen)  # its rendezvous replica, every time


# adapter -> the replica that served it, and the replica killed (later tests read these)
OWNERS: dict[str, str] = {}
KILLED: list[str] = []


def live_replicas(http: httpx.Client, count: int = 2, not_in: tuple[str, ...] = (),
                  timeout_s: float = 30) -> list[str]:
    """The engine replicas reporting to the ingress (its /metrics `replica` labels), once there
    are `count` of them, none in `not_in`, and the ingress's router routes to each of them and
    to none in `not_in` (a replica reports a moment before Serve tells the router of it: a
    request sent in between goes to another replica, and its adapter is held there; a wedged
    core's replica stops reporting, yet Serve still routes to it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        fams = {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}
        found = sorted({s.labels["replica"] for s in fams.get("vllm:num_requests_running", [])})
        routed = sorted(s.labels["replica"] for s in fams.get("loraserve_router_replicas", []))
        settled = (len(found) == count and not (set(found) | set(routed)) & set(not_in)
                   and set(found) <= set(routed))
        if settled or time.monotonic() > deadline:
            assert settled, (found, routed, not_in)
            return found
        time.sleep(0.5)


def _idle(http: httpx.Client, timeout_s: float = 60) -> None:
    """Until no replica runs or queues a request (streams of an earlier test, abandoned by its
    client, end on their replica a little later), then a moment for the router to count their
    completion: the load bound sees no leftovers."""
    deadline = time.monotonic() + timeout_s
    while True:
        fams = {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}
        busy = sum(s.value for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
                   for s in fams.get(name, []))
        if busy == 0:
            break
        assert time.monotonic() < deadline, f"{busy} requests still running or waiting"
        time.sleep(0.5)
    time.sleep(1.0)


@pytest.fixture(scope="module")
def acme_adapters(http) -> tuple[str, str]:
    """Two adapters of tenant acme (the demo's weights under new ids), loaded through the
    ingress, named so that each replica is the first choice of one of them."""
    replicas = live_replicas(http)
    names = (f"acme/a{i}" for i in range(1000))
    picked = tuple(next(n for n in names if preference(n, replicas)[0] == r) for r in replicas)
    for name, source in zip(picked, PHRASES):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": source})
        assert r.status_code == 200, r.text
    return picked


def new_adapter(http: httpx.Client, home: str, replicas: list[str], prefix: str) -> str:
    """A never-requested adapter (the demo's weights under a new id, loaded through the
    ingress) whose rendezvous first choice among `replicas` is `home`."""
    name = next(n for n in (f"{prefix}/a{i}" for i in range(1000))
                if preference(n, replicas)[0] == home)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "demo/robot"})
    assert r.status_code == 200, r.text
    return name


def test_every_adapter_goes_to_its_rendezvous_replica_from_its_first_request(http, acme_adapters) -> None:
    """Issue 26's sequence: single requests with gaps of 0, 0.5 and 2 s. Each adapter is
    served by one replica throughout, the one routing.preference ranks first, its first request
    included (Serve's multiplexing learned holders from the replicas' reports, so a new
    adapter's second request could land on the other replica)."""
    replicas = live_replicas(http)
    adapters = [*PHRASES, acme_adapters[0]]
    served: dict[str, list[str]] = {a: [] for a in adapters}
    for gap in (0, 0.5, 2):
        for adapter in adapters:
            r = chat(http, adapter, max_tokens=4)
            assert r.status_code == 200, r.text
            served[adapter].append(r.headers[HEADER])
            time.sleep(gap)
    for adapter, seen in served.items():
        assert seen == [preference(adapter, replicas)[0]] * 3, (adapter, seen)
        OWNERS[adapter] = seen[0]
    print("adapter -> replicas serving it:", {a: sorted(set(s)) for a, s in served.items()})


def test_residency_digests_show_each_adapter_on_its_replica(http) -> None:
    """GET /v1/residency on the ingress: one digest per replica; an adapter resident on a
    replica is one that replica served (affinity keeps it off the other), in its Bloom filter
    too; an unchanged digest answers 304 to its ETag."""
    assert OWNERS, "runs after the affinity test"
    replicas = live_replicas(http)
    r = http.get("/v1/residency")
    assert r.status_code == 200, r.text
    digests = {d["replica"]: d for d in r.json()["replicas"]}
    assert sorted(digests) == replicas
    for name, d in digests.items():
        assert d["slots"] == 2 and d["entries"] <= 2 and len(d["top"]) == d["entries"]
        for ref in d["top"]:
            assert OWNERS.get(ref.split("@")[0], name) == name, (ref, name, OWNERS)
            bloom = d["bloom"]
            assert ref in Bloom(bloom["m"], bloom["k"], base64.b64decode(bloom["bits"]), d["entries"])
    assert any(d["top"] for d in digests.values())
    again = http.get("/v1/residency", headers={"If-None-Match": r.headers["ETag"]})
    assert again.status_code in (200, 304)  # 304 unless a replica's pool changed meanwhile


@contextlib.contextmanager
def _streams_running(http: httpx.Client, models: list[str], headers: dict,
                     in_order: bool = False) -> Iterator[list[str]]:
    """Long streams of `models`, opened together (a barrier), or with `in_order` each once the
    one before has its first chunk, and read on (a stream nobody reads is finished by Serve's
    buffers in a moment; one read runs at the reader's pace) until the block ends; yields the
    replica serving each. Their HTTP requests, and their tenant's leases, last that long."""
    barrier, ready, release = threading.Barrier(len(models)), threading.Semaphore(0), threading.Event()
    turns = [threading.Event() for _ in models]
    turns[0].set()
    seen: dict[int, str] = {}
    ended: list[str] = []

    def hold(i: int, model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": HELD_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
        if in_order:
            turns[i].wait(60)
        else:
            barrier.wait()
        opened = False
        try:
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                assert r.status_code == 200 and next(lines)
                seen[i], opened = r.headers[HEADER], True
                ready.release()
                if i + 1 < len(turns):
                    turns[i + 1].set()
                for _ in lines:
                    if release.is_set():
                        return
                ended.append(model)  # ran to its end before the block did
        finally:
            if not opened:
                ready.release()
                if i + 1 < len(turns):
                    turns[i + 1].set()

    threads = [threading.Thread(target=hold, args=(i, m), daemon=True) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    try:
        for _ in models:
            assert ready.acquire(timeout=60)
        assert len(seen) == len(models), "a stream did not open"
        yield [seen[i] for i in range(len(models))]
        assert not ended, f"streams ended before the checks did: {ended}"
    finally:
        release.set()
        for t in threads:
            t.join(60)


def test_a_tenants_limit_holds_across_replicas(http, acme_adapters) -> None:
    """Tenant acme may hold 2 sequences in flight: with one running on each replica, a third
    is the same 429 whichever replica would have served it (the ingress admits every request)."""
    replicas = live_replicas(http)
    model = base_model(http)
    for adapter in acme_adapters:  # paged in beforehand: the streams start at once
        assert chat(http, adapter, max_tokens=1).status_code == 200
    with _streams_running(http, list(acme_adapters), ACME) as on:
        assert on == replicas  # each adapter on its own first choice: one sequence per replica
        refused = [http.post("/v1/chat/completions", headers=ACME, json={
            "model": m, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2})
            for m in [*acme_adapters, model]]
    for r in refused:
        assert r.status_code == 429 and r.headers[HEADER] == "ingress", r.text
        assert "max_concurrent" in r.json()["error"]["message"]
    assert len({(r.status_code, r.text) for r in refused}) == 1, [r.text for r in refused]
    again = http.post("/v1/chat/completions", headers=ACME, json={
        "model": acme_adapters[0], "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2})
    assert again.status_code == 200, again.text  # the streams ended: their leases went back


def fair_waiting(http: httpx.Client) -> dict[str, float]:
    """Sequences waiting at the ingress's fair-share gate, per tenant (its /metrics)."""
    fams = {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}
    return {s.labels["tenant"]: s.value for s in fams.get("loraserve_fair_share_waiting", [])}


class _GatedStreams:
    """Long streams, one thread each, that may wait at the ingress's fair-share gate: each is
    read on from its first chunk (its slot granted) until `close` ends it, so a stream that
    got a slot holds it, and what the gate granted is read off which streams have opened, not
    off when the replicas answered."""

    def __init__(self, http: httpx.Client, model: str):
        self.http, self.model = http, model
        self.tenants: list[str] = []      # stream i's tenant
        self.opened: list[int] = []       # streams with their first chunk, as they came
        self.ended: list[str] = []        # refused, failed, or ran out before closed
        self._close: list[threading.Event] = []
        self._threads: list[threading.Thread] = []

    def open(self, tenant: str) -> None:
        self.tenants.append(tenant)
        self._close.append(threading.Event())
        self._threads.append(threading.Thread(target=self._read, daemon=True,
                                              args=(len(self.tenants) - 1, tenant)))
        self._threads[-1].start()

    def _read(self, i: int, tenant: str) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": HELD_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body, timeout=3 * GATE_WAIT_S,
                                  headers={"Authorization": f"Bearer {tenant}"}) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                if r.status_code != 200 or next(lines, None) is None:
                    self.ended.append(f"{tenant} #{i}: status {r.status_code}, no first chunk")
                    return
                self.opened.append(i)
                for _ in lines:
                    if self._close[i].is_set():
                        return
                self.ended.append(f"{tenant} #{i}: ran to its end")
        except Exception as exc:  # reported by the test's asserts, not lost in a thread
            self.ended.append(f"{tenant} #{i}: {exc!r}")

    def granted(self, count: int, timeout_s: float = GATE_WAIT_S) -> Counter:
        """The tenants of the streams opened, once `count` have."""
        deadline = time.monotonic() + timeout_s
        while len(self.opened) < count:
            assert not self.ended, self.ended
            assert time.monotonic() < deadline, (count, self.opened, self.ended)
            time.sleep(0.1)
        assert len(self.opened) == count and not self.ended, (count, self.opened, self.ended)
        return Counter(self.tenants[i] for i in self.opened)

    def close(self, streams: list[int]) -> None:
        for i in streams:
            self._close[i].set()

    def close_all(self) -> None:
        self.close(list(range(len(self.tenants))))
        for t in self._threads:
            t.join(120)


def test_tenants_share_a_saturated_cluster_by_weight(http) -> None:
    """Both replicas' batches full (8 streams), then 12 streams of tenant light (weight 1)
    and, after them, 12 of heavy (weight 3), all waiting at the ingress's fair-share gate.
    The 8 streams end together, and the gate hands their slots on; each stream given one holds
    it (it is read on), so exactly 8 are granted: by the weights heavy gets 3 of every 4, 6 of
    them. Those 8 end together: 8 more granted, heavy's 12 all among the first 16. FIFO would
    grant light's 12 first, equal shares 4 and 8 of heavy's.

    Counted by which streams have their slot, not by order of completion: requests the gate
    granted in one order finish on two replicas in another (each answered within a second, the
    client's threads reading them on two busy cores), and the gate's grants are the decision."""
    model = base_model(http)
    gated = _GatedStreams(http, model)
    try:
        with _streams_running(http, [model] * 8, ADMIN):
            # light's 12, then heavy's, with no pause between: the 8 streams must outlast it,
            # and on a fast host the demo base's 4,000 tokens take a few seconds
            for tenant in WEIGHTS:
                for _ in range(12):
                    gated.open(tenant)
            deadline = time.monotonic() + GATE_WAIT_S
            while fair_waiting(http) != {tenant: 12 for tenant in WEIGHTS}:
                assert time.monotonic() < deadline, (fair_waiting(http), gated.ended)
                time.sleep(0.1)
            assert not gated.opened and not gated.ended  # all 24 wait: the 8 slots are the streams'
        first = gated.granted(8)
        assert first == {"heavy": 6, "light": 2}, [gated.tenants[i] for i in gated.opened]
        assert fair_waiting(http) == {"heavy": 6, "light": 10}  # the gate's own count agrees
        gated.close(list(gated.opened))
        both = gated.granted(16)
        print("tenants by first chunk:", " ".join(gated.tenants[i][0] for i in gated.opened))
        assert both == {"heavy": 12, "light": 4}, [gated.tenants[i] for i in gated.opened]
        assert fair_waiting(http) == {"light": 8}
    finally:
        gated.close_all()
    assert len(gated.opened) == 24 and not gated.ended, (gated.opened, gated.ended)


def router_in_flight(http: httpx.Client) -> dict[str, float]:
    """The ingress router's count of requests in flight per replica (its /metrics), zeros out."""
    fams = {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}
    return {s.labels["replica"]: s.value for s in fams.get("loraserve_router_in_flight", [])
            if s.value}


def test_streams_closed_early_leave_no_load_behind(http) -> None:
    """Two streams of one adapter, both on its first choice, closed by their client mid-stream:
    the router's count returns to zero (the ingress cancels the replica's stream; its end is
    the request's completion in Serve's router). Then a new adapter whose first choice is that
    replica is placed there: were the two still counted, the bound (ceil(1.25 x 3 / 2) = 2)
    would place it on the other replica."""
    replicas = live_replicas(http)
    first = preference("demo/robot", replicas)[0]
    fresh = new_adapter(http, first, replicas, "early")
    _idle(http)
    assert router_in_flight(http) == {}
    with _streams_running(http, ["demo/robot"] * 2, ADMIN, in_order=True) as seen:
        assert seen == [first, first]
        assert router_in_flight(http) == {first: 2}
    deadline = time.monotonic() + 30
    while (left := router_in_flight(http)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"counted after their client closed them: {left}"
    for model in ("demo/robot", fresh, fresh):
        r = chat(http, model, max_tokens=2)
        assert r.status_code == 200 and r.headers[HEADER] == first, (model, r.headers[HEADER])


def test_base_requests_reach_both_replicas(http) -> None:
    model = base_model(http)
    seen = {chat(http, model, max_tokens=2).headers[HEADER] for _ in range(24)}
    assert len(seen) == 2, seen


def test_unknown_adapter_is_the_usual_404(http) -> None:
    r = chat(http, "demo/nope")
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "model"
    assert r.headers[HEADER] == "ingress"
    assert chat(http, "no-such-model").json()["error"]["code"] == "model_not_found"


def test_stream_ends_with_done(http) -> None:
    body = {"model": "demo/robot", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 40, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers[HEADER]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == PHRASES["demo/robot"]


def test_metrics_show_every_replica(http) -> None:
    deadline = time.monotonic() + 30
    while True:
        fams = {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}
        replicas = {s.labels["replica"] for s in fams["vllm:num_requests_running"]}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2, replicas
    for name in ("vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info",
                 "loraserve_running_requests", "loraserve_adapter_resident"):
        assert {s.labels["replica"] for s in fams[name]} == replicas, name
    assert fams["loraserve_catalog_shards_degraded"][0].value == 0


def test_a_replica_whose_engine_is_wedged_stops_reporting_and_its_core_is_replaced(http) -> None:
    """A replica's engine loop that makes no progress (its core stopped: SIGSTOP) is no longer
    reported to the ingress (Ray replicas hosted the in-thread engine before, and a wedged
    engine thread kept reporting healthy: tests/engine/test_hosting_liveness.py), and the
    replica's supervisor kills, reaps and replaces the core after the engine timeout, as
    `serve` does: both replicas report again and serve."""
    replicas = live_replicas(http)
    cores = replica_cores()
    assert len(cores) == 2, [_cmdline(c) for c in cores]
    wedged = cores[0]
    wedged.send_signal(signal.SIGSTOP)
    try:
        [left] = live_replicas(http, count=1, timeout_s=60)  # the wedged one stopped reporting
        assert left in replicas
        deadline = time.monotonic() + 120  # past the engine timeout: killed, reaped, replaced
        while psutil.pid_exists(wedged.pid):
            assert time.monotonic() < deadline, "the wedged core was not replaced"
            time.sleep(0.5)
    finally:
        with contextlib.suppress(psutil.Error):
            wedged.send_signal(signal.SIGCONT)
    assert live_replicas(http, count=2, timeout_s=180) == replicas  # the same replica, a new core
    assert len(replica_cores()) == 2
    model = base_model(http)
    for i in range(8):
        r = chat(http, [model, *PHRASES][i % 4], max_tokens=4)
        assert r.status_code == 200, (i, r.text)


def test_runtime_load_goes_through_the_one_writer(http) -> None:
    """The ingress writes the catalog; a replica (read-only) serves the new adapter at once."""
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "demo/poet2", "lora_path": "demo/poet"})
    assert r.status_code == 200, r.text
    r = chat(http, "demo/poet2")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == PHRASES["demo/poet"]
    assert http.get("/v1/adapters/demo/poet2").json()["residency"] in ("gpu", "cpu")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "demo/poet2"})
    assert r.status_code == 200, r.text


# joins the server's Ray as a driver, then ray.kill()s the replica whose id comes on stdin
_KILLER = """
import sys, ray
ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)
print("joined", flush=True)
replica_id = sys.stdin.readline().strip()
names = [a for a in ray.util.list_named_actors(all_namespaces=True) if replica_id in a["name"]]
assert len(names) == 1, names
ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
print("killed", flush=True)
ray.shutdown()
"""


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """The helper's next line ("" when it said nothing in timeout_s: a Ray that never answers
    must not hang the test)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else ""


@contextlib.contextmanager
def replica_killer(server: Server) -> Iterator[Callable[[str], None]]:
    """kill(replica_id): ray.kill that replica's actor, from a driver joined to the server's
    Ray beforehand (a process of its own: the test process never runs Ray). A local Ray
    started by ray.init uses Ray's token auth unless RAY_AUTH_MODE says otherwise."""
    env = {"RAY_AUTH_MODE": "token", **os.environ}
    proc = subprocess.Popen([sys.executable, "-c", _KILLER, server.gcs_address()], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _readline(proc, 90) == "joined"

        def kill(replica_id: str) -> None:
            proc.stdin.write(replica_id + "\n")
            proc.stdin.flush()
            assert _readline(proc, 60) == "killed"

        yield kill
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_replica_dying_mid_stream_ends_it_cleanly_and_others_serve(server, http) -> None:
    body = {"model": "demo/pirate", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": HELD_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
    with replica_killer(server) as kill, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines)[6:])["choices"]
        KILLED.append(r.headers[HEADER])
        kill(r.headers[HEADER])
        rest = [line[6:] for line in lines]
    assert rest[-1] == "[DONE]"
    errors = [json.loads(e) for e in rest[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_unavailable", rest[-3:]
    model = base_model(http)
    for i in range(20):
        r = chat(http, [model, *PHRASES][i % 4], max_tokens=4)
        assert r.status_code == 200, (i, r.text)


def test_a_lost_replicas_adapters_alone_move(http) -> None:
    """Serve replaces the killed replica. An adapter a live replica holds (its /v1/residency
    digest) stays there: the survivor's own, and those it took while the other was gone. The
    others (the killed one's, and any the survivor evicted since) go to their first choice
    among the live replicas."""
    assert KILLED and OWNERS, "runs after the affinity and the replica-loss tests"
    replicas = live_replicas(http, not_in=tuple(KILLED), timeout_s=180)
    _idle(http)  # the streams of the test before have ended: no load bound in the way
    held = {ref.split("@")[0]: d["replica"] for d in http.get("/v1/residency").json()["replicas"]
            for ref in d["top"]}
    # the held ones first: serving them pages nothing in, so evicts nothing the rest may hold
    for adapter in sorted(OWNERS, key=lambda a: a not in held):
        r = chat(http, adapter, max_tokens=4)
        assert r.status_code == 200, r.text
        expected = held.get(adapter) or preference(adapter, replicas)[0]
        assert r.headers[HEADER] == expected, (adapter, OWNERS[adapter], held, replicas)
        if adapter in held:
            assert held[adapter] not in KILLED


def test_a_new_adapter_is_placed_past_its_first_choice_only_over_the_bound(http) -> None:
    """Two streams of a held adapter on its replica (a holder takes its adapter's requests
    until its batch is full: a third goes there too). A new adapter whose first choice is
    that replica is placed on the other one, the first being over the bound
    (ceil(1.25 x 3 / 2) = 2), and stays there: held, its next request goes there too, once
    the streams are gone. One whose first choice is the other replica goes there. After the
    replica-loss tests: the streams it closes early are the last load the router counts."""
    replicas = live_replicas(http)
    homed = {r: new_adapter(http, r, replicas, f"spill-{i}") for i, r in enumerate(replicas)}
    _idle(http)
    with _streams_running(http, ["demo/robot"] * 2, ADMIN, in_order=True) as seen:
        busy = seen[0]  # where demo/robot is held (since the replica-loss tests, maybe not home)
        other = next(r for r in replicas if r != busy)
        spilled, placed = homed[busy], homed[other]
        assert seen == [busy, busy], seen
        on = {m: chat(http, m, max_tokens=2).headers[HEADER] for m in ("demo/robot", spilled, placed)}
        assert on == {"demo/robot": busy, spilled: other, placed: other}, (on, busy)
    _idle(http)
    assert chat(http, spilled, max_tokens=2).headers[HEADER] == other


# -- last: SIGTERM (the module's server is gone afterwards) -----------------------------------

def _ray_left(server: Server, tree: list[psutil.Process]) -> list[str]:
    """Processes of the server's Ray still running: of its process tree before the signal, or
    of its session, or naming its Ray temp dir."""
    left = {p.pid: p for p in tree if _running(p)}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(p.pid) == server.proc.pid or server.ray_tmp in " ".join(p.info["cmdline"] or []):
                if _running(p):
                    left[p.pid] = p
        except (OSError, psutil.Error):
            pass
    return [f"{pid} {_cmdline(p)}" for pid, p in sorted(left.items())]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:100]
    except psutil.Error:
        return "?"


def test_sigterm_drains_exits_0_and_leaves_no_ray_process(server: Server, http) -> None:
    """A stream in flight at SIGTERM runs to its end (200, [DONE]); a new request meanwhile is a
    503 `server_shutting_down`, /ready 503 and /health 200; the server exits 0, and no process
    of its Ray (raylet, GCS, agents, workers) outlives it."""
    tree = psutil.Process(server.proc.pid).children(recursive=True)
    names = {_cmdline(p) for p in tree}
    assert any("raylet" in n for n in names) and any("gcs_server" in n for n in names), names
    streaming = threading.Event()
    result: dict = {}

    def long_stream() -> None:
        body = {"model": "demo/pirate", "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=120, headers=ADMIN) as r:
            result["status"] = r.status_code
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()
            result["events"] = events

    reader = threading.Thread(target=long_stream, daemon=True)
    reader.start()
    assert streaming.wait(60), result
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    refused = ready = health = None
    with httpx.Client(base_url=server.url, timeout=10, headers=ADMIN) as c:
        while refused is None and reader.is_alive() and time.monotonic() - t0 < 30:
            try:
                r = c.post("/v1/completions", json={"model": "demo/pirate", "prompt": "x",
                                                     "max_tokens": 1})
            except httpx.HTTPError:
                break
            if r.status_code == 503:
                refused = r
                ready, health = c.get("/ready").status_code, c.get("/health").status_code
            time.sleep(0.05)
    reader.join(120)
    assert refused is not None, ("no 503 while draining", result.get("status"), server.log_tail())
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert (ready, health) == (503, 200)

    assert result["status"] == 200, result
    events = result["events"]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    finishes = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length", events[-3:]

    try:
        status = server.proc.wait(SHUTDOWN_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {SHUTDOWN_TIMEOUT_S + 60} s after SIGTERM:\n{server.log_tail()}")
    took = time.monotonic() - t0
    assert status == 0, (status, server.log_tail())
    log = server.log.read_text(errors="replace")
    assert re.search(r"drained in [\d.]+ s \(requests finished: [1-9]\d*, ended at the "
                     r"deadline: 0\)", log), log[-4000:]

    deadline = time.monotonic() + 5
    while (left := _ray_left(server, tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
    print(f"SIGTERM to exit: {took:.1f} s")
