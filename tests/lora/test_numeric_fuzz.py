"""Numbers never cross sequences: a numeric fuzz over one long-running engine.

Each seeded round writes adapters whose factors come from heavy-tailed draws (Cauchy scaled up
to 1e6, spikes of +-1e30, 1e19 fills, float16's largest value, subnormals, NaN) into the
catalog, behind the writers' back (`save_revision(check=False)`), so that every later line of
defence is exercised: the page-in's factor check refuses some, others pass it and go non-finite
only at run time, where the engine fails the sequence alone and quarantines the revision.
Random mixed batches of random prompt lengths then run over an engine with a small KV cache of
small blocks, so blocks are reused from round to round (and by the prefix cache).

The property: every request on the base or on a *tame* adapter (ordinary factors, subnormals
included) finishes, with the greedy tokens and logprobs of its solo run on a separate, clean
engine that never saw a hostile adapter; every other request either finishes or fails with one
of the refusals named below, never an internal error; the engine's block books balance after
every round. On main before the null block, one 1e19 adapter in a mixed-length batch turned
every later answer to NaN (issue 22, row 1).
"""
from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import torch

from loraserve.catalog.base import BaseInfo
from loraserve.catalog.layout import AdapterWeights, save_revision
from loraserve.catalog.store import Catalog
from loraserve.catalog.targets import parse_module_path, tensor_names
from loraserve.engine.core.build import build_engine
from loraserve.engine.config import EngineConfig
from loraserve.engine.types import GenerateRequest, SamplingParams

TAME = ("tame", "subnormal")
HOSTILE = ("cauchy", "spike", "fill_1e19", "f16_max", "nan", "cauchy_lm_head")
# what a request on a hostile adapter may end with, besides finishing
REFUSALS = {"factors_too_large", "corrupt_blob", "non_finite_weights", "non_finite_output",
            "revision_quarantined"}
RANK = 2
MAX_TOKENS = 3


def _factors(style: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if style == "tame":
        return rng.normal(0, 0.3, shape)
    if style == "subnormal":
        x = rng.normal(0, 0.3, shape)
        return np.where(rng.random(shape) < 0.4, 1e-42 * np.sign(x), x)
    if style in ("cauchy", "cauchy_lm_head"):
        return rng.standard_cauchy(shape) * 10 ** rng.uniform(0, 6)
    if style == "spike":
        x = rng.normal(0, 0.3, shape)
        x.flat[rng.integers(x.size)] = rng.choice([-1e30, 1e30])
        return x
    if style == "fill_1e19":
        return np.full(shape, 1e19)
    if style == "f16_max":
        return np.full(shape, 65504.0) * rng.choice([-1, 1], shape)
    x = rng.normal(0, 0.3, shape)  # nan
    x.flat[rng.integers(x.size)] = np.nan
    return x


def _adapter(base: BaseInfo, style: str, rng: np.random.Generator) -> AdapterWeights:
    dense = sorted(p for p, m in base.modules.items() if not m.experts and p != "lm_head")
    paths = list(rng.choice(dense, size=rng.integers(1, len(dense) + 1), replace=False))
    if style == "cauchy_lm_head" or rng.random() < 0.2:
        paths.append("lm_head")
    tensors = {}
    for path in paths:
        m = base.modules[path]
        a_name, b_name = tensor_names(*parse_module_path(path))
        with np.errstate(over="ignore", invalid="ignore"):
            tensors[a_name] = torch.from_numpy(_factors(style, (RANK, m.in_features), rng).astype(np.float32))
            tensors[b_name] = torch.from_numpy(_factors(style, (m.out_features, RANK), rng).astype(np.float32))
    kinds = sorted({parse_module_path(p)[0] for p in paths})
    return AdapterWeights(base.fingerprint, RANK, kinds, torch.float32, tensors, f"fuzz:{style}")


def _engine(model: str, catalog: str, backend: str):
    return build_engine(EngineConfig(
        model_dir=model, catalog_dir=catalog, device="cpu", dtype="float32", max_model_len=64,
        max_batch_size=8, max_gpu_adapters=3, max_lora_rank=RANK, lora_backend=backend,
        block_size=4, num_kv_blocks=40))


def _run(eng, reqs: list[GenerateRequest]) -> dict[str, tuple[list[int], list[float], Exception | None]]:
    """Run reqs as one batch to the end: request id -> (tokens, logprobs, error)."""
    got = {r.request_id: ([], [], None) for r in reqs}
    for r in reqs:
        try:
            eng.add_request(r)
        except Exception as exc:  # a revision refused before it queues (quarantined, say)
            got[r.request_id] = ([], [], exc)
    for _ in range(5000):
        if not eng.has_work():
            break
        for out in eng.step():
            tokens, lps, _ = got[out.request_id]
            tokens += out.token_ids
            lps += [lp.logprob for lp in out.logprobs or []]
            if out.error is not None:
                got[out.request_id] = (tokens, lps, out.error)
        if not eng.scheduler.has_work:
            time.sleep(0.001)  # parked on a page-in: let the pager run
    assert not eng.has_work() and not eng.seqs
    return got


def _code(err: Exception) -> str:
    code = getattr(err, "code", None)
    if code:
        return code
    name = type(err).__name__
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _plan(rounds: int, per_round: int, seed: int, base: BaseInfo):
    """Seeded rounds: [(adapters written this round {id: style}, requests)]."""
    rng = np.random.default_rng(seed)
    plan, styles = [], {}
    for r in range(rounds):
        new = {}
        for i in range(3):
            style = str(rng.choice(TAME + HOSTILE, p=[0.2, 0.2] + [0.6 / len(HOSTILE)] * len(HOSTILE)))
            new[f"fuzz/r{r}-{i}-{style}"] = (style, _adapter(base, style, rng))
        styles.update({aid: s for aid, (s, _) in new.items()})
        reqs = []
        for i in range(per_round):
            adapter = rng.choice([None, *styles]) if rng.random() > 0.2 else None
            prompt = [int(t) for t in rng.integers(3, 200, size=rng.integers(1, 40))]
            reqs.append(GenerateRequest(f"r{r}-{i}", prompt, SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1), None if adapter is None else str(adapter)))
        plan.append((new, reqs))
    return plan, styles


def _runtime_only(monkeypatch, eng) -> None:
    """Take away the entry checks and the scrub: hostile factors reach the model and the Inf
    they write stays in freed blocks. What is left to hold the property is the null block
    (padding never reads a real block) and the per-row screen of the step's logits."""
    import loraserve.adapters.pager as pager_mod

    real = pager_mod.load_revision
    monkeypatch.setattr(pager_mod, "load_revision", lambda blob, **kw: real(blob, what=kw.get("what", "")))
    monkeypatch.setattr(eng.cache, "scrub", lambda blocks: None)


@pytest.mark.parametrize("backend,rounds,defences", [("torch", 6, "all"), ("torch", 6, "runtime only"),
                                                     ("triton", 2, "runtime only")])
def test_hostile_adapters_never_touch_other_sequences(tmp_path, hf_dense, one_torch_thread, monkeypatch,
                                                      backend, rounds, defences):
    base = BaseInfo.from_dir(hf_dense)
    plan, styles = _plan(rounds, per_round=8, seed=2026 + rounds, base=base)
    cat_dir, clean_dir = tmp_path / "catalog", tmp_path / "clean"
    with Catalog.create(cat_dir, shards=4) as cat:
        for new, _ in plan:
            for aid, (style, weights) in new.items():
                cat.put_revision(aid, save_revision(weights, check=False))
    shutil.copytree(cat_dir, clean_dir)
    eng, clean = _engine(str(hf_dense), str(cat_dir), backend), _engine(str(hf_dense), str(clean_dir), backend)
    if defences == "runtime only":
        _runtime_only(monkeypatch, eng)
    # blocks are handed out in a seeded random order, so any block (the one padding used to
    # read, block 0, included) may be written by a hostile sequence, then freed and reused (the
    # free list is a heap; a list in random order is not one, and heap pops and pushes still hand
    # out each of its blocks once, in an order no invariant relies on)
    eng.blocks._free = [int(b) for b in np.random.default_rng(rounds).permutation(eng.blocks.num_blocks)]
    finished_tame = hostile_failed = 0
    for _, reqs in plan:
        got = _run(eng, reqs)
        eng.blocks.check_invariants([])
        for req in reqs:
            tokens, lps, err = got[req.request_id]
            if req.adapter is None or styles[req.adapter] in TAME:
                assert err is None, f"{req.request_id} ({req.adapter}) failed: {err!r}"
                solo = _run(clean, [req])[req.request_id]
                assert tokens == solo[0], f"{req.request_id} ({req.adapter}) differs from its solo run"
                np.testing.assert_allclose(lps, solo[1], rtol=0, atol=1e-4)
                assert np.isfinite(lps).all()
                finished_tame += 1
            elif err is not None:
                assert _code(err) in REFUSALS, f"{req.request_id} ({req.adapter}): {err!r}"
                hostile_failed += 1
            else:
                assert len(tokens) == MAX_TOKENS
    assert finished_tame and hostile_failed  # the seeds exercise both sides
    quarantined = {aid for aid, _, _ in eng.snapshot.quarantined}
    assert all(styles[aid] not in TAME for aid in quarantined)
