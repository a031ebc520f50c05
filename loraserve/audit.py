"""`loraserve catalog audit`: sample adapters over every shard and check each one end to end.

Per sampled adapter (its promoted revision): the blob is read through the checksum
(`Catalog.read_blob`), the record's and the blob's base fingerprints must equal the base's, its
factors must pass the check every entry makes (`catalog.bounds`: finite, unable to overflow),
and every target is run through the engine's own LoRA path (the adapter paged into an
`AdapterPool` by the engine's loader, then the engine's `LoRALinear` / `LoRAExpertLinear` wrappers
around the base weight, torch backend) on random inputs, compared with `x @ (W + B·A)^T` computed
from a float64 merged copy of the base weight. Any failure makes the audit fail.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.bounds import check_servable
from loraserve.catalog.dtypes import dtype_name
from loraserve.catalog.baseweights import load_module_weight
from loraserve.catalog.errors import CatalogError
from loraserve.catalog.targets import EXPERT_KINDS, module_path, parse_module_path, parse_tensor_name, tensor_names
from loraserve.catalog.layout import load_revision
from loraserve.catalog.records import RevisionRecord
from loraserve.catalog.store import Catalog
from loraserve.adapters.pool import AdapterPool, PoolConfig, TargetSpec
from loraserve.kernels import LoRAOps
from loraserve.lora.layers import LoRAExpertLinear, LoRALinear, LoRAState
from loraserve.model.moe import ExpertLinear

TOKENS = 5  # random input rows per target (MoE: (token, expert) pairs)


@dataclass(slots=True)
class AuditReport:
    """Outcome: shards covered out of all, adapters audited, worst relative error, failures."""

    shards: int
    shards_covered: int
    audited: int
    max_error: float
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and self.audited > 0

    def lines(self) -> list[str]:
        return [
            f"shards covered: {self.shards_covered}/{self.shards}",
            f"adapters audited: {self.audited}",
            f"max error: {self.max_error:.3e}",
            f"failures: {len(self.failures)}",
            *(f"  FAIL {f}" for f in self.failures),
        ]


def sample_ids(catalog: Catalog, sample: int, seed: int) -> list[str]:
    """`sample` adapter ids, at least one from every non-empty shard when `sample` allows."""
    rng = random.Random(seed)
    per_shard = [catalog.shard(i).read(_shard_ids_fn(rng, sample), default=[]) for i in range(catalog.shards)]
    picked = [ids.pop() for ids in per_shard if ids]  # one per shard first
    rest = [a for ids in per_shard for a in ids]
    rng.shuffle(rest)
    picked += rest[: max(sample - len(picked), 0)]
    return sorted(picked[:sample]) if sample < len(picked) else sorted(picked)


def _shard_ids_fn(rng: random.Random, k: int):
    """Reservoir-sample up to k policy keys of one shard (one pass over the keys, no values)."""

    def scan(txn, dbs):
        chosen: list[str] = []
        for n, key in enumerate(txn.cursor(db=dbs.policy).iternext(keys=True, values=False)):
            if n < k:
                chosen.append(bytes(key).decode())
            elif (j := rng.randrange(n + 1)) < k:
                chosen[j] = bytes(key).decode()
        rng.shuffle(chosen)
        return chosen

    return scan


def adapter_modules(weights) -> list[tuple[str, int | None]]:
    """(kind, layer) of every module an adapter's tensors cover, in module-path order."""
    return sorted({parse_tensor_name(n)[:2] for n in weights.tensors}, key=lambda m: module_path(*m))


class EnginePath:
    """The engine's own LoRA serving path for one adapter: `AdapterPool.load` (the engine's
    page-in: rank-row allocation, B transposed) and the `LoRALinear` / `LoRAExpertLinear` wrappers
    the engine puts around the base modules, fed through a `LoRAState` exactly as the runner does."""

    def __init__(self, base: BaseInfo, weights, backend: str = "torch"):
        layers: dict[str, list[int]] = {}
        infos = {}
        for kind, layer in adapter_modules(weights):
            layers.setdefault(kind, []).append(layer or 0)
            infos[kind] = base.modules[module_path(kind, layer)]
        specs = [TargetSpec(k, sorted(ls), infos[k].in_features, infos[k].out_features, infos[k].experts)
                 for k, ls in layers.items()]
        self.pool = AdapterPool(specs, PoolConfig(max_slots=1, max_rank=weights.rank))
        self.pool.load(("audit", "r"), weights)
        self.state = LoRAState(self.pool, LoRAOps(backend, "cpu"))

    def run(self, path: str, w: torch.Tensor, x: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
        """base(x) + LoRA(x) for module `path` with base weight w (float32)."""
        kind, layer = parse_module_path(path)
        self.state.set_slots([0] * x.shape[0])
        if experts is None:
            base = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            base.weight.data = w
            return LoRALinear(base, kind, layer or 0, self.state)(x)
        order = torch.argsort(experts, stable=True)  # ExpertLinear wants pairs grouped by expert
        base = ExpertLinear(w.shape[0], w.shape[2], w.shape[1])
        base.weight.data = w
        out = LoRAExpertLinear(base, kind, layer or 0, self.state)(
            x[order], experts[order].long(), order.long())
        return torch.empty_like(out).index_copy_(0, order, out)


class Auditor:
    """Audits revisions against one base; owns the base-weight cache for the run."""

    def __init__(self, base: BaseInfo, seed: int = 0) -> None:
        self.base = base
        self.gen = torch.Generator().manual_seed(seed)
        self._weights: dict[str, torch.Tensor] = {}

    def weight(self, path: str) -> torch.Tensor:
        if path not in self._weights:
            self._weights[path] = load_module_weight(self.base, path).double()
        return self._weights[path]

    def check_target(self, engine: EnginePath, path: str, a: torch.Tensor, b: torch.Tensor) -> float:
        """Relative max error of serving (base + LoRA) vs the merged float64 reference for one module."""
        kind, _ = parse_module_path(path)
        w = self.weight(path)  # [out, in] or [E, out, in]
        x = torch.randn(TOKENS, a.shape[-1], generator=self.gen)
        experts = torch.randint(0, a.shape[0], (TOKENS,), generator=self.gen, dtype=torch.int32) if kind in EXPERT_KINDS else None
        a32, b32 = a.float(), b.float()
        merged = w + b32.double() @ a32.double()  # [out, in] or [E, out, in]
        if experts is None:
            ref = x.double() @ merged.t()
        else:
            ref = torch.einsum("ti,toi->to", x.double(), merged[experts.long()])
        with torch.no_grad():
            out = engine.run(path, w.float(), x, experts)
        return float((out.double() - ref).abs().max() / (ref.abs().max() + 1e-12))

    def audit(self, catalog: Catalog, adapter_id: str, tol: float) -> tuple[float, str | None]:
        """(max relative error, failure message or None) for the adapter's promoted revision."""
        try:
            record = catalog.resolve(adapter_id)
            weights = load_revision(catalog.read_blob(record))
            _check_fingerprint(record, weights.base_fingerprint, self.base.fingerprint)
            # the check every entry makes (export, import, runtime load, page-in): one rule
            check_servable(weights.tensors, dtype_name(weights.dtype), what=f" ({record.ref})")
            err = 0.0
            modules = adapter_modules(weights)
            unknown = [module_path(*m) for m in modules if module_path(*m) not in self.base.modules]
            if unknown:
                return err, f"{record.ref}: targets {unknown[0]}, which the base lacks"
            engine = EnginePath(self.base, weights)
            for kind, layer in modules:
                a_name, b_name = tensor_names(kind, layer)
                err = max(err, self.check_target(engine, module_path(kind, layer), weights.tensors[a_name],
                                                 weights.tensors[b_name]))
        except CatalogError as e:
            return 0.0, f"{adapter_id}: {e}"
        return err, (f"{record.ref}: error {err:.3e} > {tol:.1e}" if err > tol else None)


def _check_fingerprint(record: RevisionRecord, blob_fp: str, base_fp: str) -> None:
    if record.base_fingerprint != base_fp or blob_fp != base_fp:
        raise CatalogError(f"{record.ref}: built for base {record.base_fingerprint} (blob: {blob_fp}), audited base is {base_fp}")


def run_audit(catalog_dir: str | Path, model_dir: str | Path, sample: int = 256, seed: int = 0,
              tol: float = 1e-4) -> AuditReport:
    """Audit `sample` adapters spread over every shard; see the module docstring."""
    base = BaseInfo.from_dir(model_dir)
    auditor = Auditor(base, seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: thread hand-off costs far more than it saves
    try:
        return _audit_sample(catalog_dir, auditor, sample, seed, tol)
    finally:
        torch.set_num_threads(threads)


def _audit_sample(catalog_dir, auditor: Auditor, sample: int, seed: int, tol: float) -> AuditReport:
    with Catalog.open(catalog_dir, readonly=True) as catalog:
        ids = sample_ids(catalog, sample, seed)
        covered = len({catalog.shard_index(a) for a in ids})
        max_err, failures = 0.0, []
        for adapter_id in ids:
            err, failure = auditor.audit(catalog, adapter_id, tol)
            max_err = max(max_err, err)
            if failure:
                failures.append(failure)
        return AuditReport(catalog.shards, covered, len(ids), max_err, failures)
