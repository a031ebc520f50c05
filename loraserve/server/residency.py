"""`GET /v1/residency`: which adapter revisions each engine holds in its device pool, as a digest
of bounded size, for external routers (a Gateway API Inference Extension endpoint picker, an
llm-d scorer) that cannot scrape one series per adapter at 10^6 adapters.

Per engine (one on a single server, one per replica on Ray Serve):

    {"replica": "local" | the Serve replica id,
     "version": 7,          # changes exactly when the resident set changes (per replica)
     "entries": 31,         # resident revisions
     "slots": 32,           # device pool slots (max_lora)
     "bloom": {"m": 8192, "k": 7, "hash": "xxh3_128-double", "bits": "<base64>",
               "fp_rate": 0.0004},
     "top": ["acme/support@r3", ...]}   # up to TOP_K resident revisions, most recently used first

The Bloom filter holds every resident `adapter_id@revision` (UTF-8): bit positions are
`(h1 + i * h2) mod 2**64 mod m` for i in 0..k-1, h1 the low and h2 the high 64 bits of the
xxh3-128 digest (h2 forced odd), bit j being bit `j % 8` (least significant first) of byte
`j // 8`. No false negatives; false positives at about `fp_rate` (the filter's estimate for its
fill). `m` grows with the resident count (about 9.6 bits per entry, 1% false positives) up to
MAX_BITS (1 MiB of filter), so the digest of a replica is bounded at any count; at 10^6
entries the capped filter answers about 2% false positives. `top` names the revisions used
last (in use now, then most recently paged in), exact: a picker that finds its revision there
needs no filter at all, and a device pool of up to TOP_K slots is listed whole.

The response's ETag covers every replica's version and `top`; a poller sending If-None-Match
gets 304 while nothing changed. Recency is observed from the engines' published snapshots: on
each request of this route, and on Ray each time a replica reports (every report interval,
0.5 s).

Guarded like /metrics: with a keys file, an admin key or the metrics key.
"""
from __future__ import annotations

import base64
import math
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from loraserve.engine.snapshot import EngineSnapshot
from loraserve.server.router_metrics import labelled_snapshots

FORMAT = "loraserve-residency/1"
HASH = "xxh3_128-double"
BITS_PER_ENTRY = 9.6       # -ln(0.01) / ln(2)^2: 1% false positives at the optimal k
MIN_BITS = 1024
MAX_BITS = 8 * 2**20       # 1 MiB of filter per replica, whatever the count
TOP_K = 64
LOCAL = "local"            # the replica name of a single server's one engine

_MASK = (1 << 64) - 1


def bloom_size(n: int) -> tuple[int, int]:
    """(m bits, k hashes) for n entries: ~1% false positives, m a multiple of 8 in
    [MIN_BITS, MAX_BITS], k optimal for that m (1..16)."""
    m = min(MAX_BITS, max(MIN_BITS, math.ceil(n * BITS_PER_ENTRY)))
    m = (m + 7) // 8 * 8
    k = 1 if n == 0 else max(1, min(16, round(m / n * math.log(2))))
    return m, k


def _hashes(refs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(h1, h2) per ref as uint64 arrays (h2 odd: its multiples cover every residue of 2^64)."""
    digests = [xxhash.xxh3_128_intdigest(r.encode()) for r in refs]
    h1 = np.fromiter((d & _MASK for d in digests), dtype=np.uint64, count=len(refs))
    h2 = np.fromiter(((d >> 64) | 1 for d in digests), dtype=np.uint64, count=len(refs))
    return h1, h2


def _positions(h1: np.ndarray, h2: np.ndarray, m: int, k: int) -> np.ndarray:
    """Bit positions, shape (len, k): (h1 + i * h2) mod 2^64 mod m (numpy's uint64 wraps)."""
    i = np.arange(k, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return (h1[:, None] + i[None, :] * h2[:, None]) % np.uint64(m)


@dataclass(frozen=True, slots=True)
class Bloom:
    m: int
    k: int
    bits: bytes  # m // 8 bytes, bit j = bit j % 8 of byte j // 8
    n: int

    @classmethod
    def of(cls, refs: list[str]) -> Bloom:
        m, k = bloom_size(len(refs))
        flags = np.zeros(m, dtype=bool)
        if refs:
            flags[_positions(*_hashes(refs), m, k).ravel()] = True
        return cls(m, k, np.packbits(flags, bitorder="little").tobytes(), len(refs))

    def __contains__(self, ref: str) -> bool:
        positions = _positions(*_hashes([ref]), self.m, self.k)[0].tolist()
        return all(self.bits[j >> 3] >> (j & 7) & 1 for j in positions)

    @property
    def fp_rate(self) -> float:
        """The estimated false-positive rate at this fill: (1 - e^(-k n / m))^k."""
        return (1 - math.exp(-self.k * self.n / self.m)) ** self.k

    def as_dict(self) -> dict:
        return {"m": self.m, "k": self.k, "hash": HASH, "fp_rate": round(self.fp_rate, 6),
                "bits": base64.b64encode(self.bits).decode()}


@dataclass(slots=True)
class ReplicaResidency:
    """One engine's resident set as last seen, its version and its use times."""

    resident: frozenset[str] = frozenset()
    version: int = 0
    used: dict[str, float] = field(default_factory=dict)  # ref -> last seen in use (or paged in)
    digest: dict | None = None                            # cached for `version`

    def observe(self, snap: EngineSnapshot, now: float) -> None:
        refs = frozenset(f"{aid}@{rev}" for aid, rev in snap.resident)
        if refs != self.resident:
            for ref in refs - self.resident:  # paged in: some request just asked for it
                self.used[ref] = now
            self.used = {r: t for r, t in self.used.items() if r in refs}
            self.resident, self.version, self.digest = refs, self.version + 1, None
        in_use = {a.split("@", 1)[0] for a in (*snap.running_adapters, *snap.waiting_adapters)}
        for ref in refs:
            if ref.split("@", 1)[0] in in_use and self.used.get(ref) != now:
                self.used[ref] = now
                self.digest = None  # `top` may reorder; the version (the set) stays

    def as_dict(self, name: str, slots: int) -> dict:
        if self.digest is None:
            top = sorted(self.resident, key=lambda r: (-self.used.get(r, 0.0), r))[:TOP_K]
            self.digest = {"replica": name, "version": self.version,
                           "entries": len(self.resident), "slots": slots,
                           "bloom": Bloom.of(sorted(self.resident)).as_dict(), "top": top}
        return {**self.digest, "slots": slots}


class ResidencyBook:
    """Every engine's ReplicaResidency (replicas gone from the engine's view are dropped)."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaResidency] = {}

    def observe(self, name: str, snap: EngineSnapshot, now: float | None = None) -> None:
        self.replicas.setdefault(name, ReplicaResidency()).observe(snap, now or time.monotonic())

    def digest(self, engine) -> tuple[list[dict], str]:
        """(one digest per engine behind `engine`, the ETag of them all)."""
        snaps = [(labels.get("replica", LOCAL), snap) for labels, snap in labelled_snapshots(engine)
                 if snap is not None]  # None: an engine that publishes none (a test double)
        live = {name for name, _ in snaps}
        for name in [n for n in self.replicas if n not in live]:
            del self.replicas[name]
        now = time.monotonic()
        for name, snap in snaps:
            self.observe(name, snap, now)
        out = [self.replicas[name].as_dict(name, snap.max_lora) for name, snap in sorted(snaps)]
        # the versions, and the order of `top` (use reorders it without changing the set)
        seen = repr([(d["replica"], d["version"], d["top"]) for d in out])
        tag = xxhash.xxh3_64_hexdigest(seen.encode())
        return out, f'"{tag}"'


def residency_router() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/residency")
    async def residency(request: Request) -> Response:
        """The resident adapter revisions of every engine, as bounded digests (module doc)."""
        ctx = request.app.state.ctx
        book: ResidencyBook = request.app.state.residency
        digests, etag = book.digest(ctx.engine)
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers={"ETag": etag})
        body = {"object": "residency", "format": FORMAT, "model": ctx.engine.model_name,
                "replicas": digests}
        return JSONResponse(body, headers={"ETag": etag})

    return router


def install_residency(app) -> ResidencyBook:
    """Register GET /v1/residency on `app` (its book is `app.state.residency`)."""
    app.state.residency = ResidencyBook()
    app.include_router(residency_router())
    return app.state.residency
