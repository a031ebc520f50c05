"""The decoder every supported architecture runs (Qwen3, Qwen3-MoE, Llama, Qwen2, Mistral), in
plain torch over a flattened batch of tokens.

The model never sees sequences: `forward(input_ids [T], positions [T], attn)` runs T tokens from any
number of sequences, and the `attn` callable (the engine's paged attention) decides which tokens
attend to which. With `attn=None` the T tokens are one causal sequence (tests, training).
Architectures differ only through `ModelConfig` (see `arch.py`): the parts are in `layers.py`,
`rope.py` and `moe.py`. Letters: T tokens, H hidden, V vocab.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from loraserve.kernels import cpu_fused
from loraserve.model.config import ModelConfig
from loraserve.model import decode_plan
from loraserve.model.layers import MLP, Attention, AttentionFn, RMSNorm, call_projection
from loraserve.model.moe import SparseMoeBlock
from loraserve.model.rope import Device, RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: Device = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, device)
        self.mlp = SparseMoeBlock(cfg, device) if cfg.is_moe_layer(layer_idx) \
            else MLP(cfg.hidden_size, cfg.intermediate_size, device, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig, device: Device = None):
        super().__init__()
        # _weight skips nn.Embedding's normal_ init (slow on the meta device, overwritten anyway)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, device=device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, l, device) for l in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn | None) -> Tensor:
        """input_ids [T], positions [T] -> hidden [T, H] after the final norm."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, x.dtype)
        if self._fused_residuals(x):
            return self._forward_fused(x, rope, attn)
        for layer in self.layers:
            x = layer(x, rope, attn)
        return self.norm(x)

    def _fused_residuals(self, x: Tensor) -> bool:
        """Whether `_forward_fused` may run: serving on the CPU (kernels.cpu_fused.usable), the
        norms in x's dtype, and no hook on a decoder layer or one of its norms, nor a global one
        (their forwards are not called there: the norms' weights are read directly)."""
        return (x.dim() == 2 and cpu_fused.usable(x) and self.norm.weight.dtype == x.dtype
                and not any(self._uncalled_hooks()) and not any(decode_plan.GLOBAL_HOOKS))

    def _uncalled_hooks(self) -> list[dict]:
        """The hook dicts of the modules `_forward_fused` does not call (the layers, their norms,
        the final norm), listed once per registration count: a hook added later lands in a listed
        dict, a module swapped in later makes a new list."""
        listed = self.__dict__.get("_hook_dicts")
        if listed is None or listed[0] != decode_plan.registrations():
            mods = [*self.layers, *(m for layer in self.layers for m in (layer.input_layernorm,
                                                                         layer.post_attention_layernorm)), self.norm]
            listed = (decode_plan.registrations(), [d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks)])
            self.__dict__["_hook_dicts"] = listed
        return listed[1]

    def _planned(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn | None):
        """(plan, mode, the step's attention closure) when the layers may run as a `DecodePlan`
        (built on first use, rebuilt after any registration; model.decode_plan), else None."""
        decoder = getattr(attn, "qkv_decoder", None)
        if decoder is None:
            return None
        built = self.__dict__.get("_plan")
        if built is None or built[0] != decode_plan.registrations():
            built = (decode_plan.registrations(), decode_plan.DecodePlan.build(self))
            self.__dict__["_plan"] = built
        plan = built[1]
        attend = decoder(x, rope) if plan is not None else None  # None for a prefill step
        mode = plan.applies(x) if attend is not None else 0
        return (plan, mode, attend) if mode else None

    def _forward_fused(self, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn | None) -> Tensor:
        """The layers' arithmetic with each residual add fused into the norm after it (vLLM's
        fused add + RMSNorm): x += attn(norm(x)); x += mlp(norm(x)) as DecoderLayer.forward,
        in one op per add and norm instead of seven."""
        planned = self._planned(x, rope, attn)
        if planned is not None:
            plan, mode, attend = planned
            return plan.run(x, attend, deltas=mode == 2)
        first = self.layers[0].input_layernorm
        h = cpu_fused.rms_norm(x, first.weight, first.eps)
        for i, layer in enumerate(self.layers):
            post = layer.post_attention_layernorm
            x, h = cpu_fused.add_rms_norm(x, layer.self_attn(h, rope, attn), post.weight, post.eps)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = cpu_fused.add_rms_norm(x, layer.mlp(h), after.weight, after.eps)
        return h


class CausalLM(nn.Module):
    """Decoder plus unembedding; `lm_head.weight` is `embed_tokens.weight` when tied.

    Construction does not initialise weights meaningfully (embedding and experts are left
    uninitialised): load a checkpoint, or draw weights as `model.tiny.random_model` does.
    `device="meta"` builds the skeleton the loader assigns into."""

    def __init__(self, config: ModelConfig, *, device: Device = None):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_word_embeddings:
            self.tie_weights()

    def fuse_projections(self) -> int:
        """q/k/v and gate/up of every layer into one GEMM each (`Attention.fuse`, `MLP.fuse`), in
        place; returns how many fused GEMMs there now are. A decode step at one token is mostly
        weight reading and per-op overhead: one larger GEMM reads its weights at least as fast as
        three and costs one call. Call it after loading and before packing or LoRA wrappers."""
        fused = 0
        for layer in self.model.layers:
            fused += layer.self_attn.fuse()
            if isinstance(layer.mlp, MLP):
                fused += layer.mlp.fuse()
        return fused

    def tie_weights(self) -> None:
        """Make lm_head share the embedding Parameter (a no-op for untied configs)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn | None = None) -> Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H] (final norm applied)."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"expected input_ids [T] and positions [T], got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, H] -> logits [M, V] float32, through self.lm_head (LoRA-wrappable)."""
        return call_projection(self.lm_head, hidden).float()
