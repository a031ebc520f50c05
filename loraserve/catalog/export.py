"""PEFT adapter -> serving layout: check against the base, fold scale, pack experts, cast.

Accepted PEFT module forms (after dropping `base_model.model.` and `model.`):
    layers.{l}.self_attn.{q,k,v,o}_proj | layers.{l}.mlp.{gate,up,down}_proj | lm_head   dense
    layers.{l}.mlp.experts.{e}.{gate,up,down}_proj                                  per expert
    layers.{l}.mlp.experts[.base_layer]*     PEFT `target_parameters` on fused experts:
        gate_up_proj [E, 2I, H]: A [E*R, H], B [2I, E*R]  (B columns are (rank, expert) major-minor)
        down_proj    [E, H, I]:  A [E*R, I], B [H, E*R]
Every module's scale (alpha/r or alpha/sqrt(r)) is folded into B (float32 math, one rounding), ranks are
zero-padded to the adapter's max rank, experts are packed to A [E, R, in], B [E, out, R].
NaN or Inf never enters: a non-finite PEFT factor, or one that scaling or the cast to the serving
dtype overflows, is a NonFiniteWeights (400) naming the tensor.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

from .base import BaseInfo, ModuleInfo
from .dtypes import torch_dtype
from .errors import ExportError, NonFiniteWeights
from .layout import AdapterWeights
from .targets import ALL_KINDS, KINDS_BY_NAME, parse_expert_plane_path, parse_module_path, tensor_names
from .peft_reader import PeftLoraConfig, as_source, group_factors, read_peft_tensors, split_base_copies
from .source import AdapterSource

_FUSED = re.compile(r"^(layers\.\d+\.mlp\.experts)((?:\.base_layer)*)$")

Factor = tuple[str, torch.Tensor]  # (PEFT tensor name, tensor)


def _expect(base: BaseInfo, path: str, tensor_name: str) -> ModuleInfo:
    if path not in base.modules:
        raise ExportError(
            f"{tensor_name}: targets {path!r}, which base {base.model_dir} ({base.arch}, "
            f"{base.num_layers} layers) does not have; the adapter was made for another base"
        )
    return base.modules[path]


def _check_shape(name: str, t: torch.Tensor, want: tuple[int, ...], base: BaseInfo) -> None:
    if tuple(t.shape) != want:
        raise ExportError(
            f"{name}: shape {list(t.shape)} does not fit base {base.model_dir} (expected {list(want)}); "
            "the adapter was made for another base or is damaged"
        )


def fold(b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """B * scale in the serving dtype, multiplied in float32 and rounded once (one pass when B already has `dtype`)."""
    if b.dtype == dtype:
        return b * scale  # CPU low-precision mul computes in float32 and rounds once
    return (b.float() * scale).to(dtype)


def _dense(base: BaseInfo, path: str, a: Factor, b: Factor, r: int, scale: float, dtype: torch.dtype) -> tuple:
    m = _expect(base, path, a[0])
    _check_shape(a[0], a[1], (r, m.in_features), base)
    _check_shape(b[0], b[1], (m.out_features, r), base)
    return a[1].to(dtype), fold(b[1], scale, dtype)


def _fused(base: BaseInfo, layer_path: str, a: Factor, b: Factor, r_cfg: int, scale: float, dtype: torch.dtype) -> dict:
    gate = _expect(base, f"{layer_path}.gate_proj", a[0])
    down = _expect(base, f"{layer_path}.down_proj", a[0])
    e = gate.experts
    is_gate_up = a[1].shape[1] == gate.in_features and b[1].shape[0] == 2 * gate.out_features
    is_down = a[1].shape[1] == down.in_features and b[1].shape[0] == down.out_features
    if is_gate_up == is_down:
        raise ExportError(f"{a[0]}: shape {list(a[1].shape)} fits neither experts.gate_up_proj nor experts.down_proj")
    _check_shape(a[0], a[1], (e * r_cfg, a[1].shape[1]), base)
    _check_shape(b[0], b[1], (b[1].shape[0], e * r_cfg), base)
    A = a[1].to(dtype).reshape(e, r_cfg, -1)  # [E, R, in]
    B = fold(b[1], scale, dtype).reshape(b[1].shape[0], r_cfg, e).permute(2, 0, 1)  # [E, out, R]
    if is_down:
        return {f"{layer_path}.down_proj": (A, B)}
    i = gate.out_features
    return {f"{layer_path}.gate_proj": (A, B[:, :i]), f"{layer_path}.up_proj": (A.clone(), B[:, i:])}  # shared A, own copies


def _pack_experts(base: BaseInfo, experts: dict[str, dict[int, tuple]], names: dict[str, str]) -> dict:
    packed = {}
    for path, by_e in experts.items():
        m = _expect(base, path, names[path])
        missing = sorted(set(range(m.experts)) - set(by_e))
        if missing or len(by_e) != m.experts:
            raise ExportError(f"{names[path]}: {path} has LoRA for {len(by_e)} experts, base has {m.experts}")
        ranks = {by_e[e][0].shape[0] for e in by_e}
        r = max(ranks)
        packed[path] = (
            torch.stack([F.pad(by_e[e][0], (0, 0, 0, r - by_e[e][0].shape[0])) for e in range(m.experts)]),
            torch.stack([F.pad(by_e[e][1], (0, r - by_e[e][1].shape[1])) for e in range(m.experts)]),
        )
    return packed


def convert_modules(groups: dict, cfg: PeftLoraConfig, base: BaseInfo,
                    dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Serving module path -> (A, B) in the serving dtype with scale folded into B, ranks not yet padded."""
    out: dict[str, tuple] = {}
    experts: dict[str, dict[int, tuple]] = {}
    expert_names: dict[str, str] = {}
    for module, f in sorted(groups.items()):
        path = module.removeprefix("model.")
        r, scale = cfg.rank_and_scale(module.removesuffix(".base_layer"))
        if (plane := parse_expert_plane_path(path)):
            packed_path, expert = plane
            _expect(base, packed_path, f["A"][0])
            # per-expert modules are checked against the packed module's per-expert (in, out)
            info = base.modules[packed_path]
            _check_shape(f["A"][0], f["A"][1], (r, info.in_features), base)
            _check_shape(f["B"][0], f["B"][1], (info.out_features, r), base)
            experts.setdefault(packed_path, {})[expert] = (f["A"][1].to(dtype), fold(f["B"][1], scale, dtype))
            expert_names[packed_path] = f["A"][0]
        elif (m := _FUSED.match(path)):
            r, scale = cfg.rank_and_scale(module.replace(".base_layer", ""))
            out.update(_fused(base, m[1], f["A"], f["B"], r, scale, dtype))
        else:
            try:
                kind, _ = parse_module_path(path)
            except ValueError:
                raise ExportError(f"{f['A'][0]}: unknown LoRA target {module!r}; supported kinds: {', '.join(ALL_KINDS)}") from None
            if KINDS_BY_NAME[kind].is_expert:  # packed experts come per expert or fused, never as one module
                raise ExportError(f"{f['A'][0]}: unknown LoRA target {module!r}")
            out[path] = _dense(base, path, f["A"], f["B"], r, scale, dtype)
    out.update(_pack_experts(base, experts, expert_names))
    return out


def _check_base_copies(copies: dict[str, torch.Tensor], base: BaseInfo) -> None:
    """Saved base-weight copies (lm_head / embeddings) must have the base's shape (no resized vocab)."""
    for name, t in copies.items():
        path = name.removeprefix("base_model.model.").removesuffix(".base_layer.weight")
        if path == "model.embed_tokens":
            continue  # embeddings are not a supported target; their LoRA factors are refused by name
        m = _expect(base, path.removeprefix("model."), name)
        _check_shape(name, t, (m.out_features, m.in_features), base)


def check_finite(tensors: dict[str, torch.Tensor], what: str = "") -> None:
    """NonFiniteWeights naming the first floating-point tensor holding NaN or Inf."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise NonFiniteWeights(f"{name}: contains {bad} values{what}; non-finite weights are never imported")


def _pad_rank(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad A [.., r, in] rows and B [.., out, r] columns to `rank` (the delta is unchanged)."""
    extra = rank - a.shape[-2]
    return (F.pad(a, (0, 0, 0, extra)), F.pad(b, (0, extra))) if extra else (a, b)


def export_peft(peft_dir: str | Path | AdapterSource, base: BaseInfo, dtype: str | None = None,
                source: str = "") -> AdapterWeights:
    """Turn a PEFT LoRA directory into serving-layout weights for `base`; ExportError names the bad tensor.

    `peft_dir` may be an AdapterSource (confined, bounded reads: the server's imports).
    """
    src = as_source(peft_dir)
    cfg = PeftLoraConfig.from_dir(src)
    lora, copies = split_base_copies(read_peft_tensors(src))
    _check_base_copies(copies, base)
    check_finite(lora)
    groups = group_factors(lora)
    if not groups:
        raise ExportError(f"{src.shown}: adapter has no LoRA tensors")
    serving = torch_dtype(dtype or base.dtype)
    modules = convert_modules(groups, cfg, base, serving)
    rank = max(a.shape[-2] for a, _ in modules.values())
    tensors = {}
    for path, (a, b) in modules.items():
        a, b = _pad_rank(a, b, rank)
        a_name, b_name = tensor_names(*parse_module_path(path))
        tensors[a_name], tensors[b_name] = a.contiguous(), b.contiguous()
    check_finite(tensors, f" after scaling by alpha/r and casting to {serving}")
    kinds = sorted({parse_module_path(p)[0] for p in modules}, key=ALL_KINDS.index)
    return AdapterWeights(base.fingerprint, rank, kinds, serving, tensors, source or f"peft:{src.name}")
