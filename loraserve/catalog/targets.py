"""The one table of LoRA target kinds: names, module paths, blob tensor names (torch-free).

A *target kind* is a short module name (`q_proj`, `experts.gate_proj`, `lm_head`). Each kind
but `lm_head` sits under every decoder layer at a fixed attribute path (`self_attn.q_proj`,
`mlp.experts.gate_proj`); its *module path* in a blob is `layers.{l}.{attr}`, the Hugging Face
module path without `model.`, and its blob tensors are `{module path}.lora_A` / `.lora_B`.
`lm_head` has no layer: its module path is `lm_head`.

Everything that names kinds, module paths or blob tensors (catalog format, adapter pool, LoRA
wrappers, trainer) reads this table; nothing else spells them out.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

LORA_A, LORA_B = "lora_A", "lora_B"


@dataclass(frozen=True, slots=True)
class TargetKind:
    """One LoRA target kind: its name and its attribute path under a decoder layer.

    `attr` is relative to `model.layers[l]` for layer kinds and to the causal-LM model for
    `lm_head`. Expert kinds are packed MoE weights `[E, out, in]`; the others are `[out, in]`.
    """

    name: str
    attr: str
    is_expert: bool = False
    is_lm_head: bool = False

    def module_path(self, layer: int | None) -> str:
        """Blob module path in `layer` (`lm_head` ignores `layer`)."""
        return self.attr if self.is_lm_head else f"layers.{layer}.{self.attr}"

    def tensor_names(self, layer: int | None) -> tuple[str, str]:
        """Blob tensor names `(lora_A name, lora_B name)` in `layer`."""
        path = self.module_path(layer)
        return f"{path}.{LORA_A}", f"{path}.{LORA_B}"


LM_HEAD = "lm_head"

TARGET_KINDS: tuple[TargetKind, ...] = (  # the table, in canonical order
    TargetKind("q_proj", "self_attn.q_proj"),
    TargetKind("k_proj", "self_attn.k_proj"),
    TargetKind("v_proj", "self_attn.v_proj"),
    TargetKind("o_proj", "self_attn.o_proj"),
    TargetKind("gate_proj", "mlp.gate_proj"),
    TargetKind("up_proj", "mlp.up_proj"),
    TargetKind("down_proj", "mlp.down_proj"),
    TargetKind("experts.gate_proj", "mlp.experts.gate_proj", is_expert=True),
    TargetKind("experts.up_proj", "mlp.experts.up_proj", is_expert=True),
    TargetKind("experts.down_proj", "mlp.experts.down_proj", is_expert=True),
    TargetKind(LM_HEAD, LM_HEAD, is_lm_head=True),
)
KINDS_BY_NAME = MappingProxyType({k.name: k for k in TARGET_KINDS})
_LAYER_KINDS_BY_ATTR = MappingProxyType({k.attr: k for k in TARGET_KINDS if not k.is_lm_head})

ALL_KINDS = tuple(k.name for k in TARGET_KINDS)
LAYER_KINDS = tuple(k for k in TARGET_KINDS if not k.is_lm_head)  # the kinds under each decoder layer
DENSE_KINDS = tuple(k.name for k in LAYER_KINDS if not k.is_expert)  # attention + dense MLP
EXPERT_KINDS = tuple(k.name for k in TARGET_KINDS if k.is_expert)


def _is_index(text: str) -> bool:
    """Whether `text` is a non-negative int in canonical spelling (`3`, not `03`), so names round-trip."""
    return text.isascii() and text.isdigit() and str(int(text)) == text


def target_kind(name: str) -> TargetKind:
    """The table row of kind `name`; ValueError naming the known kinds otherwise."""
    try:
        return KINDS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown LoRA target kind {name!r}; known: {', '.join(ALL_KINDS)}") from None


def module_path(kind: str, layer: int | None) -> str:
    """Blob module path of `kind` in `layer`: `layers.3.self_attn.q_proj`; `lm_head` has no layer."""
    return target_kind(kind).module_path(layer)


def tensor_names(kind: str, layer: int | None) -> tuple[str, str]:
    """Blob tensor names `(lora_A name, lora_B name)` of `kind` in `layer` (`lm_head` ignores it)."""
    return target_kind(kind).tensor_names(layer)


def parse_module_path(path: str) -> tuple[str, int | None]:
    """Inverse of `module_path`: `layers.3.mlp.experts.up_proj` -> (`experts.up_proj`, 3).

    ValueError if `path` is not the module path of a known kind.
    """
    if path == LM_HEAD:
        return LM_HEAD, None
    head, _, attr = path.partition(".")
    layer, _, attr = attr.partition(".")
    kind = _LAYER_KINDS_BY_ATTR.get(attr)
    # only the canonical spelling of a layer (`3`, not `03`) names a module, so names round-trip
    if head != "layers" or not _is_index(layer) or kind is None:
        raise ValueError(f"not an adapter module path: {path!r}")
    return kind.name, int(layer)


def parse_tensor_name(name: str) -> tuple[str, int | None, bool]:
    """Inverse of `tensor_names`: `layers.0.mlp.up_proj.lora_B` -> (`up_proj`, 0, False); `True` for A."""
    path, _, leaf = name.rpartition(".")
    if leaf not in (LORA_A, LORA_B):
        raise ValueError(f"{name}: tensor names must end in .{LORA_A} or .{LORA_B}")
    kind, layer = parse_module_path(path)
    return kind, layer, leaf == LORA_A


def parse_targets(text: str) -> list[str]:
    """`"q_proj,v_proj"` -> `["q_proj", "v_proj"]`, each checked against the known kinds."""
    kinds = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [k for k in kinds if k not in KINDS_BY_NAME]
    if unknown or not kinds:
        raise ValueError(f"unknown target kinds {unknown or text!r}; known: {', '.join(ALL_KINDS)}")
    return kinds


def expert_plane_path(path: str, expert: int) -> str:
    """Module path of one expert of packed expert module `path`, as transformers lays experts out:
    `layers.1.mlp.experts.up_proj`, 3 -> `layers.1.mlp.experts.3.up_proj`."""
    kind, _ = parse_module_path(path)
    if not KINDS_BY_NAME[kind].is_expert:
        raise ValueError(f"{path}: not an expert module path")
    owner, _, proj = path.rpartition(".")
    return f"{owner}.{expert}.{proj}"


def parse_expert_plane_path(path: str) -> tuple[str, int] | None:
    """Inverse of `expert_plane_path`: (packed module path, expert), or None for any other path."""
    head, _, proj = path.rpartition(".")
    owner, _, expert = head.rpartition(".")
    if not _is_index(expert):
        return None
    packed = f"{owner}.{proj}"
    try:
        kind, _ = parse_module_path(packed)
    except ValueError:
        return None
    return (packed, int(expert)) if KINDS_BY_NAME[kind].is_expert else None
