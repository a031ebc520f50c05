"""LoRA wrappers for the base model's modules, fed by one per-step `LoRAState`.

The model file is never edited: `attach_lora` replaces each target module (nn.Linear or
ExpertLinear) by a wrapper that runs the base op, then adds every token's own adapter delta with
the SGMV ops in `kernels` over the device adapter pool (rank-row layout, docs/INTERNALS.md §2).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import kernels
from loraserve.catalog.targets import EXPERT_KINDS, LAYER_KINDS, LM_HEAD
from loraserve.kernels.tracing import compiling
from loraserve.kernels import LoRAMeta, cpu_fused
from loraserve.kernels.torch_backend import PlanCache

HOST_META_MAX_TOKENS = 512  # CPU steps up to this many tokens group them in Python (LoRAMeta.from_host)


class LoRAState:
    """What every wrapper reads during one forward: each token's adapter slot and the grouped
    metadata built from it (once per step for dense targets, once per MoE layer for experts)."""

    def __init__(self, pool, ops: kernels.LoRAOps):
        self.pool = pool
        self.max_slots = pool.config.max_slots
        self.num_experts = max((s.experts for s in pool.specs.values()), default=0) or 1
        self.covers_lm_head = "lm_head" in pool.specs  # else the logits pass needs no slots
        self.ops = ops  # the backend chosen once for the device
        self.backend = ops.backend
        self.device = ops.device
        self.token_slots = torch.empty(0, dtype=torch.int32, device=self.device)  # [T]
        self.meta: LoRAMeta | None = None      # None = no LoRA token in this step
        self._pair_key: int | None = None
        self._pair_meta: LoRAMeta | None = None
        # torch backend: the step's plans, kept while the wrappers pass the same meta object
        self.plans = PlanCache()
        self._step_key: tuple | None = None  # (slots, pool version) the dense meta is for

    def fork(self) -> "LoRAState":
        """A state over the same pool with its own per-step fields: a second thread's forward
        (the background compile, `engine.core.background_compile`) sets its slots there
        without touching the steps this state serves."""
        twin = copy.copy(self)
        twin.token_slots = torch.empty(0, dtype=torch.int32, device=self.device)
        twin.meta, twin._pair_key, twin._pair_meta, twin._step_key = None, None, None, None
        twin.plans = PlanCache()
        return twin

    def set_slots(self, slots: list[int]) -> None:
        """Each token's adapter slot for the next forward. A decode step whose batch layout and
        pool are those of the step before (the steady state) keeps that step's metadata, and so
        its plans: the pool's version changes with every adapter load and eviction."""
        self._pair_key = None
        if max(slots, default=-1) < 0:  # no LoRA token: the wrappers skip; the cache stays
            self.meta = None
            return
        key = (tuple(slots), self.pool.version)
        if key == self._step_key:
            self.meta = self._step_meta
            return
        self.token_slots = torch.tensor(slots, dtype=torch.int32, device=self.device)
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
        """y += LoRA(x) for one target module. On the torch backend the plan is built by the
        first layer of each kind (`plan_key`: kind, or (kind, layer) for MoE) and reused."""
        A, B, table, ranks = weights
        if self.backend == "torch" and not meta.moe and compiling():
            add_lora_traced(y, x, A, B, table, ranks, self.token_slots)
            return
        if self.backend != "torch" or compiling():
            # a compiled step calls the registered op, which plans for itself on the torch
            # backend: the plan cache is host-side Python state a graph cannot hold
            self.ops.add_lora(y, x, A, B, table, ranks, meta)
            return
        self.plans.add(plan_key, y, x, A, B, table, ranks, meta)


def add_lora_traced(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    table: torch.Tensor, ranks: torch.Tensor, token_slots: torch.Tensor) -> None:
    """y[t] += B[a]^T (A[a] x[t]) for each token t with slot a = token_slots[t] >= 0, written as
    tensor code for a compiled CPU step to fuse: the shrink is one reduction that reads token
    t's rank rows of A where they lie, the expand a batched GEMM over its rows of B, gathered
    (of the variants timed in one graph, this was fastest: bench/RESULTS.md). No plan: the torch
    backend's per-step plans are host state a graph cannot keep, and replanning behind the
    custom op made a compiled LoRA step 3x slower than eager. Float32 inside,
    like the eager path at reduced precision. A rank position past a slot's rank, or a
    base-only token, selects 0 with `where`, never multiplies by it: the rows such a position
    would read belong to other adapters and may hold Inf (0 * Inf = NaN)."""
    slot = token_slots.long().clamp(min=0)                                       # [T]
    r = torch.arange(table.shape[1], device=table.device)
    live = (r[None, :] < ranks[slot][:, None]) & (token_slots >= 0)[:, None]     # [T, R]
    rows = table[slot].long()                                                    # [T, R]
    h = torch.where(live, (A[rows].float() * x.float()[:, None, :]).sum(-1), 0.0)    # [T, R]
    b = torch.where(live[..., None], B[rows].float(), 0.0)                       # [T, R, H_out]
    y.add_(torch.bmm(h[:, None, :], b).squeeze(1).to(y.dtype))


class LoRALinear(nn.Module):
    """y = base(x) + x @ A[a(t)]^T @ B[a(t)]^T per token t. x [T, H_in] -> [T, H_out].

    A base that is one slice of a fused GEMM (`model.layers.FusedSlice`) is called with the fused
    output too, and y is its columns of it: the delta lands there in place."""

    def __init__(self, base: nn.Module, kind: str, layer: int, state: LoRAState):
        super().__init__()
        self.base, self.kind, self.layer, self.state = base, kind, layer, state
        self.weights = state.tensors(kind, layer)
        # (meta, A, B): while the state's metadata is `meta` (a steady decode step keeps it), this
        # target's delta is one `lora_addmm_` of the adapter's rank rows A, B (the plan's own call,
        # made here without the plan lookup: 7 targets x 30 layers a step at SmolLM2's shapes)
        self._one: tuple | None = None

    @property
    def idle(self) -> bool:
        """No LoRA token in this step: a call returns its base's output unchanged (a caller that
        reads a fused output whole may skip it: `model.layers._project`)."""
        return self.state.meta is None

    def one_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B): this step's delta is `lora_addmm_(y, x, A, B)` and nothing else (the steady
        decode of one adapter, after this wrapper's first call with the step's metadata made its
        plan: `_one`), else None. For a caller that runs the layer without calling the wrapper
        (`model.decode_plan`)."""
        one = self._one
        return None if one is None or one[0] is not self.state.meta else one[1:]

    def forward(self, x: torch.Tensor, *fused: torch.Tensor) -> torch.Tensor:
        base = self.base  # a plain nn.Linear is called as F.linear: two Python frames fewer
        y = F.linear(x, base.weight, base.bias) if type(base) is nn.Linear else base(x, *fused)
        st = self.state
        meta = st.meta
        if meta is None:
            return y
        if not compiling():  # (read before _one: a traced graph never guards on it)
            rows = self.one_rows()
            if rows is not None and cpu_fused.usable(x):
                cpu_fused.lora_addmm_(y, x, *rows)
                return y
        # the engine's rows are 2-D already: no view/reshape dispatch (196 targets a step at 0.6B shapes)
        y2, x2 = y if y.dim() == 2 else y.view(-1, y.shape[-1]), x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        st.add(y2, x2, self.weights, meta, self.kind)
        if st.backend == "torch" and not meta.moe and y2 is y and x2 is x and not compiling():
            pair = st.plans.fused_one(self.kind, meta, y, x, self.weights[0], self.weights[1])
            self._one = None if pair is None else (meta, *pair)
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
        for kind in LAYER_KINDS:
            try:
                mod = _get(layer, kind.attr)
            except AttributeError:
                continue
            out.append((kind.name, l, f"model.{kind.module_path(l)}", mod))
    out.append((LM_HEAD, 0, LM_HEAD, model.lm_head))
    return out


def twin_model(model: nn.Module, state: LoRAState | None, twin_state: LoRAState | None) -> nn.Module:
    """A second module tree over the same parameters, buffers and packed weights (nothing is
    copied but the modules themselves), whose LoRA wrappers read `twin_state` instead of
    `state`: a thread can run (and compile) it while the engine thread steps the original."""
    new = object.__new__(type(model))
    new.__dict__ = dict(model.__dict__)
    new._parameters, new._buffers = dict(model._parameters), dict(model._buffers)
    new._modules = {k: None if m is None else twin_model(m, state, twin_state)
                    for k, m in model._modules.items()}
    if state is not None and new.__dict__.get("state") is state:
        new.__dict__["state"] = twin_state
    return new


def attach_lora(model: nn.Module, state: LoRAState, kinds: set[str] | None = None) -> None:
    """Wrap the target modules in place (idempotent per module)."""
    for kind, layer, path, mod in target_modules(model):
        if kinds is not None and kind not in kinds or isinstance(mod, (LoRALinear, LoRAExpertLinear)):
            continue
        cls = LoRAExpertLinear if kind in EXPERT_KINDS else LoRALinear
        _set(model, path, cls(mod, kind, layer, state))
