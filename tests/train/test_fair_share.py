"""Fair share counts training tokens with serving tokens: a tenant's training slices charge its
virtual time in the scheduler (Scheduler.charge, called by the engine core after each slice), so
while it trains heavily the other tenants' requests are admitted first."""
from __future__ import annotations

import pytest

from loraserve.engine.config import EngineConfig
from loraserve.engine.core.block_manager import BlockManager
from loraserve.engine.core.llm_engine import LLMEngine
from loraserve.engine.core.scheduler import Scheduler
from loraserve.engine.core.sequence import Sequence
from loraserve.engine.core.training import trainer_of
from loraserve.engine.types import GenerateRequest, SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
RUN = {"rank": 2, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}


def _queue(sched: Scheduler) -> None:
    """Four 8-token prompts from each of tenants a and b, a's first."""
    for i, tenant in enumerate(["a"] * 4 + ["b"] * 4):
        sched.add(Sequence(f"{tenant}{i}", [100 * i + j for j in range(8)], PARAMS, tenant=tenant))


@pytest.mark.parametrize("trained", [0, 20, 4000])
def test_a_tenants_training_tokens_count_in_its_share(trained):
    """A batch of 4 with 4 prompts from each tenant: alternating turns; after a's training
    tokens, b's prompts first, as many more as the charge is worth (lag bounded by one budget)."""
    sched = Scheduler(BlockManager(64, 4), max_batch_size=4, max_batched_tokens=64)
    _queue(sched)
    sched.charge("a", trained, 1.0)
    batch, is_prefill = sched.schedule()
    assert is_prefill
    tenants = [s.tenant for s in batch]
    assert tenants.count("b") == {0: 2, 20: 3, 4000: 4}[trained], tenants


def test_a_charge_weighs_by_the_tenants_weight():
    sched = Scheduler(BlockManager(64, 4), max_batch_size=4, max_batched_tokens=64)
    _queue(sched)
    sched.charge("a", 20, 4.0)  # a's weight 4: 20 tokens cost it 5 of virtual time, less than a prompt
    assert [s.tenant for s in sched.schedule()[0]].count("b") == 2


def test_no_charge_while_nobody_is_served():
    sched = Scheduler(BlockManager(64, 4), max_batch_size=4, max_batched_tokens=64)
    sched.charge("a", 4000, 1.0)  # idle engine: nobody owes anybody
    _queue(sched)
    assert [s.tenant for s in sched.schedule()[0]].count("b") == 2


def test_the_engine_charges_each_training_slice_to_its_tenant(demo_dense):
    """A forward_backward slice of tenant a in the engine core: b's waiting prompts are
    admitted before a's in the next step."""
    engine = LLMEngine(EngineConfig(model_dir=str(demo_dense), device="cpu", dtype="float32", max_model_len=128,
                                    torch_threads=1, max_batch_size=4, max_batched_tokens=64))
    seqs = [engine.add_request(GenerateRequest(f"{t}{i}", [10 + i] * 8, PARAMS, tenant=t))
            for i, t in enumerate(["a"] * 4 + ["b"] * 4)]
    core = trainer_of(engine)
    core.create("run", RUN)
    toks = list(range(1, 22))
    core.begin("run", "p", [[toks[:-1], {"target_tokens": toks[1:], "weights": [1.0] * 20}]],
               "cross_entropy", None, True, "a", 1.0)
    assert core.advance("p", 64) is not None  # one slice: 20 tokens, forward and backward
    assert not core.payers
    engine.step()
    admitted = [s.tenant for s in seqs if s.num_cached > 0]
    assert admitted == ["b"] * 4
