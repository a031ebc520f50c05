"""GET /v1/residency (server/residency.py): the Bloom filter's bounds (no false negatives, its
false-positive rate, its size at 10^6 entries), `top` by recent use, versions and ETags, one
digest per replica, and the route's guard (like /metrics)."""
from __future__ import annotations

import base64
import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loraserve.engine.snapshot import EngineSnapshot
from loraserve.server import build_app
from loraserve.server.residency import (MAX_BITS, TOP_K, Bloom, ReplicaResidency, bloom_size)

from .fake_engine import FakeEngine


def refs(n: int, seed: int = 0, prefix: str = "t") -> list[str]:
    rng = random.Random(seed)
    return [f"{prefix}{rng.randrange(10**4)}/a{i}@r{rng.randrange(9)}" for i in range(n)]


def test_a_bloom_has_no_false_negatives_and_its_estimated_false_positives() -> None:
    members = refs(5000)
    bloom = Bloom.of(members)
    assert all(r in bloom for r in members)
    others = refs(20000, seed=1, prefix="u")
    fp = sum(r in bloom for r in others) / len(others)
    assert bloom.fp_rate < 0.012          # ~9.6 bits an entry: about 1%
    assert fp <= 2 * bloom.fp_rate + 0.002, (fp, bloom.fp_rate)


def test_a_million_entries_stay_within_the_size_bound() -> None:
    """At 10^6 resident revisions the filter is capped at MAX_BITS (1 MiB) and still answers
    every member, with about 2% false positives (seeded, 20,000 non-members)."""
    members = refs(10**6)
    bloom = Bloom.of(members)
    assert bloom.m == MAX_BITS and len(bloom.bits) == MAX_BITS // 8 == 2**20
    assert all(r in bloom for r in members[:: 997])
    others = refs(20000, seed=2, prefix="u")
    fp = sum(r in bloom for r in others) / len(others)
    assert bloom.fp_rate < 0.025 and fp <= bloom.fp_rate + 0.01, (fp, bloom.fp_rate)
    assert len(base64.b64encode(bloom.bits)) <= 4 * MAX_BITS // 8 // 3 + 4


def test_bloom_sizes() -> None:
    assert bloom_size(0) == (1024, 1)
    m, k = bloom_size(1000)
    assert m % 8 == 0 and 9000 <= m <= 10000 and k == 7
    assert bloom_size(10**7)[0] == MAX_BITS


def test_the_wire_form_is_what_the_doc_says() -> None:
    """A picker's membership test from the documented rule alone (no loraserve import)."""
    import xxhash
    bloom = Bloom.of(["acme/support@r3", "beta/x@r1"])
    d = bloom.as_dict()
    bits, m, k = base64.b64decode(d["bits"]), d["m"], d["k"]

    def has(ref: str) -> bool:
        h = xxhash.xxh3_128_intdigest(ref.encode())
        h1, h2 = h & (2**64 - 1), (h >> 64) | 1
        return all(bits[(j := (h1 + i * h2) % 2**64 % m) // 8] >> (j % 8) & 1 for i in range(k))

    assert has("acme/support@r3") and has("beta/x@r1") and not has("acme/support@r4")


def test_versions_change_with_the_set_and_top_follows_use() -> None:
    book = ReplicaResidency()
    book.observe(EngineSnapshot(resident=frozenset({("t/a", "r1"), ("t/b", "r1")})), now=1.0)
    assert book.version == 1
    book.observe(EngineSnapshot(resident=frozenset({("t/a", "r1"), ("t/b", "r1")}),
                                running_adapters=("t/a",)), now=2.0)
    assert book.version == 1  # same set: same version
    assert book.as_dict("local", 2)["top"] == ["t/a@r1", "t/b@r1"]
    book.observe(EngineSnapshot(resident=frozenset({("t/a", "r1"), ("t/c", "r2")})), now=3.0)
    d = book.as_dict("local", 2)
    assert book.version == 2 and d["entries"] == 2
    assert d["top"] == ["t/c@r2", "t/a@r1"]  # just paged in, then used at 2.0


def test_top_is_bounded() -> None:
    book = ReplicaResidency()
    book.observe(EngineSnapshot(resident=frozenset((f"t/a{i}", "r1") for i in range(500))), 1.0)
    assert len(book.as_dict("local", 500)["top"]) == TOP_K


@dataclass
class SnapshotEngine(FakeEngine):
    """FakeEngine publishing snapshots: one engine, or several as Ray's ingress facade does."""

    snapshot: EngineSnapshot | None = field(default_factory=EngineSnapshot)
    replicas: dict | None = None
    config: Any = field(default_factory=lambda: SimpleNamespace(block_size=8))  # vLLM's gauges read it

    def replica_snapshots(self) -> dict | None:
        return self.replicas


def test_the_route_serves_one_digest_with_an_etag() -> None:
    engine = SnapshotEngine(snapshot=EngineSnapshot(resident=frozenset({("acme/support", "r1")}),
                                                    max_lora=4))
    with TestClient(build_app(engine)) as http:
        r = http.get("/v1/residency")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["format"] == "loraserve-residency/1" and body["model"] == "fake-base"
        (d,) = body["replicas"]
        assert (d["replica"], d["entries"], d["slots"], d["top"]) == ("local", 1, 4, ["acme/support@r1"])
        assert http.get("/v1/residency", headers={"If-None-Match": r.headers["ETag"]}).status_code == 304
        engine.snapshot = EngineSnapshot(resident=frozenset({("acme/support", "r2")}), max_lora=4)
        r2 = http.get("/v1/residency", headers={"If-None-Match": r.headers["ETag"]})
        assert r2.status_code == 200 and r2.json()["replicas"][0]["version"] == d["version"] + 1


def test_the_route_serves_a_digest_per_replica() -> None:
    engine = SnapshotEngine(replicas={
        "rep-b": EngineSnapshot(resident=frozenset({("t/x", "r1")}), max_lora=2),
        "rep-a": EngineSnapshot(resident=frozenset({("t/y", "r1"), ("t/z", "r1")}), max_lora=2)})
    with TestClient(build_app(engine)) as http:
        digests = http.get("/v1/residency").json()["replicas"]
        assert [(d["replica"], d["entries"]) for d in digests] == [("rep-a", 2), ("rep-b", 1)]
        del engine.replicas["rep-b"]  # a replica gone: its digest goes too
        assert [d["replica"] for d in http.get("/v1/residency").json()["replicas"]] == ["rep-a"]


def test_the_route_is_guarded_like_metrics(tmp_path: Path) -> None:
    sha = lambda k: hashlib.sha256(k.encode()).hexdigest()  # noqa: E731
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[keys.adm]\nsha256 = "{sha("adm")}"\nrole = "admin"\n\n'
                    f'[keys.usr]\nsha256 = "{sha("usr")}"\nrole = "user"\ntenants = ["acme"]\n')
    with TestClient(build_app(SnapshotEngine(), keys=str(keys), metrics_key="mk")) as http:
        def get(key: str | None) -> int:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return http.get("/v1/residency", headers=headers).status_code
        assert (get(None), get("usr"), get("adm"), get("mk")) == (401, 403, 200, 200)
