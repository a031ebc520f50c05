"""LoRA wrappers for the base model's modules, fed by one per-step `LoRAState`.

The model file is never edited: `attach_lora` replaces each target module (nn.Linear or
ExpertLinear) by a wrapper that runs the base op, then adds every token's own adapter delta with
the SGMV ops in `kernels` over the device adapter pool (rank-row layout, docs/INTERNALS.md §2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import kernels
from loraserve.kernels import LoRAMeta

DENSE_KINDS = {  # kind -> attribute path under model.layers[l]
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
EXPERT_KINDS = {"experts.gate_proj": "mlp.experts.gate_proj", "experts.up_proj": "mlp.experts.up_proj",
                "experts.down_proj": "mlp.experts.down_proj"}

HOST_META_MAX_TOKENS = 512  # CPU steps up to this many tokens group them in Python (LoRAMeta.from_host)


class LoRAState:
    """What every wrapper reads during one forward: each token's adapter slot and the grouped
    metadata built from it (once per step for dense targets, once per MoE layer for experts)."""

    def __init__(self, pool, backend: str, device: torch.device):
        self.pool = pool
        self.max_slots = pool.config.max_slots
        self.num_experts = max((s.experts for s in pool.specs.values()), default=0) or 1
        self.covers_lm_head = "lm_head" in pool.specs  # else the logits pass needs no slots
        self.backend = backend
        self.device = device
        self.token_slots = torch.empty(0, dtype=torch.int32, device=device)  # [T]
        self.meta: LoRAMeta | None = None      # None = no LoRA token in this step
        self._pair_key: int | None = None
        self._pair_meta: LoRAMeta | None = None
        self._plans: dict = {}  # torch backend: kind -> row-gather plan (dense targets)
        self._plan_rows: list = []  # (meta, row table, ranks, plan) of the dense plans
        self._moe_plans: dict = {}  # (kind, layer) -> plan for this step's routing (MoE targets)
        self._moe_plan_rows: list = []
        self._step_key: tuple | None = None  # (slots, pool version) the dense meta and plans are for

    def set_slots(self, slots: list[int]) -> None:
        """Each token's adapter slot for the next forward. A decode step whose batch layout and
        pool are those of the step before (the steady state) keeps that step's metadata and
        plans: the pool's version changes with every adapter load and eviction."""
        self._pair_key = None
        self._moe_plans.clear()
        self._moe_plan_rows.clear()
        if max(slots, default=-1) < 0:  # no LoRA token: the wrappers skip; the cache stays
            self.meta = None
            return
        key = (tuple(slots), self.pool.version)
        if key == self._step_key:
            self.meta = self._step_meta
            return
        self.token_slots = torch.tensor(slots, dtype=torch.int32, device=self.device)
        self._plans.clear()
        self._plan_rows.clear()
        s_max = min(len(slots), self.max_slots)
        if self.device.type == "cpu" and len(slots) <= HOST_META_MAX_TOKENS:
            self.meta = LoRAMeta.from_host(slots, max_segments=s_max)
        else:
            self.meta = LoRAMeta.build(self.token_slots, max_segments=s_max)
        self._step_key, self._step_meta = key, self.meta

    def pair_meta(self, layer: int, expert_ids: torch.Tensor, token_index: torch.Tensor) -> LoRAMeta:
        """Metadata for MoE (token, expert) pairs; gate/up/down of one layer share it. Keyed by
        layer (reset every step): tensor addresses are reused across layers by the allocator."""
        key = layer
        if key != self._pair_key:
            slots = self.token_slots[token_index]
            n_seg = max(min(slots.numel(), self.max_slots * self.num_experts), 1)
            if self.device.type == "cpu" and slots.numel() <= HOST_META_MAX_TOKENS:
                self._pair_meta = LoRAMeta.from_host(slots.tolist(), max_segments=n_seg,
                                                     experts=expert_ids.tolist())
            else:
                self._pair_meta = LoRAMeta.build(slots, max_segments=n_seg,
                                                 token_experts=expert_ids.to(torch.int32))
            self._pair_key = key
        return self._pair_meta

    def tensors(self, kind: str, layer: int) -> tuple[torch.Tensor, ...]:
        """(A_rows, B_rows, row_table, ranks) of one target module: fixed for the pool's life."""
        pool = self.pool
        return pool.A_rows[kind][layer], pool.B_rows[kind][layer], pool.row_table[kind], pool.ranks[kind]

    def add(self, y: torch.Tensor, x: torch.Tensor, weights: tuple[torch.Tensor, ...], meta: LoRAMeta,
            plan_key) -> None:
        """y += LoRA(x) for one target module. On the torch backend the row-gather plan is built
        by the first layer of each kind in a step and reused by the others."""
        A, B, table, ranks = weights
        if self.backend != "torch":
            kernels.add_lora(y, x, A, B, table, ranks, meta, backend=self.backend)
            return
        dense = isinstance(plan_key, str)
        plans = self._plans if dense else self._moe_plans
        plan = plans.get(plan_key)
        if plan is not None:  # later layers: same shapes as the checked first call
            plan.run(y, x, A, B)
            return
        rows = self._plan_rows if dense else self._moe_plan_rows
        plan = self._shared_plan(rows, meta, table, ranks) or kernels.plan_torch(meta, table, ranks, A, B)
        plans[plan_key] = plan
        rows.append((meta, table, ranks, plan))
        kernels.add_lora_torch(y, x, A, B, table, ranks, meta, plan=plan)

    @staticmethod
    def _shared_plan(plan_rows: list, meta: LoRAMeta, table: torch.Tensor, ranks: torch.Tensor):
        """A plan this step already built for another kind with the same rows: adapters that
        target every kind at one rank get identical row tables in each kind's pool (the free
        lists hand rows out in the same order), so q/k/v/o/gate/up/down share one plan."""
        for plan_meta, plan_table, plan_ranks, plan in plan_rows:
            if plan_meta is meta and torch.equal(plan_ranks, ranks) and torch.equal(plan_table, table):
                return plan
        return None


class LoRALinear(nn.Module):
    """y = base(x) + x @ A[a(t)]^T @ B[a(t)]^T per token t. x [T, H_in] -> [T, H_out]."""

    def __init__(self, base: nn.Module, kind: str, layer: int, state: LoRAState):
        super().__init__()
        self.base, self.kind, self.layer, self.state = base, kind, layer, state
        self.weights = state.tensors(kind, layer)
        # a plain nn.Linear is called as F.linear: two Python frames fewer on the hot path
        self._linear = type(base) is nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = F.linear(x, base.weight, base.bias) if self._linear else base(x)
        st = self.state
        if st.meta is None:
            return y
        st.add(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.weights, st.meta, self.kind)
        return y


class LoRAExpertLinear(nn.Module):
    """Per (token, expert) pair: y = base(x, e) + x @ A[a, e]^T @ B[a, e]^T."""

    def __init__(self, base: nn.Module, kind: str, layer: int, state: LoRAState):
        super().__init__()
        self.base, self.kind, self.layer, self.state = base, kind, layer, state
        self.weights = state.tensors(kind, layer)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        y = self.base(x, expert_ids, token_index)
        st = self.state
        if st.meta is None or x.shape[0] == 0:
            return y
        meta = st.pair_meta(self.layer, expert_ids, token_index)
        st.add(y, x.contiguous(), self.weights, meta, (self.kind, self.layer))
        return y


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, module)


def target_modules(model: nn.Module) -> list[tuple[str, int, str, nn.Module]]:
    """Every LoRA target the base has: (kind, layer, module path, module). lm_head has layer 0."""
    out = []
    for l, layer in enumerate(model.model.layers):
        for kind, path in {**DENSE_KINDS, **EXPERT_KINDS}.items():
            try:
                mod = _get(layer, path)
            except AttributeError:
                continue
            out.append((kind, l, f"model.layers.{l}.{path}", mod))
    out.append(("lm_head", 0, "lm_head", model.lm_head))
    return out


def attach_lora(model: nn.Module, state: LoRAState, kinds: set[str] | None = None) -> None:
    """Wrap the target modules in place (idempotent per module)."""
    for kind, layer, path, mod in target_modules(model):
        if kinds is not None and kind not in kinds or isinstance(mod, (LoRALinear, LoRAExpertLinear)):
            continue
        cls = LoRAExpertLinear if kind in EXPERT_KINDS else LoRALinear
        _set(model, path, cls(mod, kind, layer, state))
