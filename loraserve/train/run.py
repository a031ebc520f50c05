"""A training run on the resident base: forward / forward_backward in token-bounded slices,
optim_step, and its training state.

A pass (`TrainingRun.start`) works through its datums a slice at a time (`Pass.advance(budget)`),
so the host can run decode steps between slices; a slice's whole datums run as one batch
(grouped.py, which also batches several runs' passes into one slice), and a datum longer than
the slice budget runs a chunk per slice (chunked.py), so neither a slice's time nor its
activations grow with a datum's length. Its gradients collect in the pass's own buffer
and reach the run only when the whole pass is done and finite: a diverging batch (NaN/Inf loss
or gradient) fails its own call and leaves the run as it was, so no later save can serve it.
Gradients of successive passes add up, as Tinker's forward_backward calls do, until optim_step.

optim_step refuses (TrainingError, a 400 naming the parameter) Adam parameters out of range, and
a step whose factors would leave what serving admits (`catalog.bounds`: NaN/Inf, or a gain past
the serving dtype's limit): such a step is undone, factors, moments and step count as before,
and the gradients stay for a step with sane parameters.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from loraserve.catalog.bounds import GAIN_LIMITS
from loraserve.model import CausalLM
from loraserve.train.chunked import ChunkedDatum
from loraserve.train.config import RunConfig, TrainingError
from loraserve.train.factors import LoRAFactors
from loraserve.train.grouped import pick, run_group
from loraserve.train.losses import loss_spec


@dataclass(frozen=True, slots=True)
class Datum:
    """One sequence: input tokens [N] and the loss inputs, each [N] (target_tokens int64, the rest float32)."""

    tokens: Tensor
    inputs: dict[str, Tensor]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True, slots=True)
class AdamParams:
    """The SDK's AdamParams: decoupled weight decay (AdamW), optional global grad-norm clip (0 = off).

    Made only with values a step can use (TrainingError naming the field otherwise): every value
    a finite number; learning_rate, eps, weight_decay and grad_clip_norm not negative, eps above
    0; beta1 and beta2 in [0, 1); the scalars AdamW applies to float32 factors (eps,
    learning_rate x weight_decay) inside float32."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TrainingError(f"adam_params.{name} must be a number, got {value!r}", param=name)
            if not math.isfinite(value):
                raise TrainingError(f"adam_params.{name} must be a finite number, got {value}", param=name)
        for name in ("learning_rate", "weight_decay", "grad_clip_norm"):
            if getattr(self, name) < 0:
                raise TrainingError(f"adam_params.{name} must be >= 0, got {getattr(self, name)}", param=name)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise TrainingError(f"adam_params.{name} must be in [0, 1), got {getattr(self, name)}", param=name)
        if not 0 < self.eps <= FLOAT32_MAX:
            raise TrainingError(f"adam_params.eps must be > 0 and within float32 (<= {FLOAT32_MAX:.3g}), "
                                f"got {self.eps}", param="eps")
        if self.learning_rate > FLOAT32_MAX or self.learning_rate * self.weight_decay > FLOAT32_MAX:
            name = "learning_rate" if self.learning_rate > FLOAT32_MAX else "weight_decay"
            raise TrainingError(f"adam_params.learning_rate {self.learning_rate:g} (x weight_decay "
                                f"{self.weight_decay:g}) overflows the float32 factors (> {FLOAT32_MAX:.3g})",
                                param=name)


@dataclass(slots=True)
class PassResult:
    """Per datum `logprobs` and `elementwise_loss` [N] (float32), and the pass's metrics."""

    outputs: list[dict[str, Tensor]]
    metrics: dict[str, float]


BACKWARD_COST = 2  # a backward pass costs about two forwards (in forward-token equivalents)


@dataclass(eq=False)  # a pass is itself (a key of the grouped slice's maps), not its fields
class Pass:
    """One forward or forward_backward call in progress."""

    run: TrainingRun
    data: list[Datum]
    loss: str
    loss_config: dict[str, float]
    backward: bool
    done_datums: int = 0
    outputs: list[dict[str, Tensor]] = field(default_factory=list)
    grads: list[Tensor] | None = None
    loss_sum: float = 0.0
    chunked: ChunkedDatum | None = None  # a datum longer than the budget, part way
    work: int = 0  # forward-token equivalents computed so far (what fair share charges)

    @property
    def done(self) -> bool:
        return self.done_datums == len(self.data)

    def next_work(self, max_tokens: int) -> int:
        """Forward-token equivalents this pass's next slice computes for it (what fair share will
        charge), run alone: its next whole datums that fit, or its long datum's next chunk."""
        if self.done:
            return 0
        if self.groupable(max_tokens):
            tokens = sum(d.num_tokens for _, ds in pick([self], max_tokens) for d in ds)
            return tokens * (1 + BACKWARD_COST * self.backward)
        c = self.chunked
        if c is None:  # the long datum's first forward chunk
            return min(max_tokens, self.data[self.done_datums].num_tokens)
        if not c.forward_done:
            s, e = c.bounds[c.forward_next]
            return e - s
        s, e = c.back_bounds[c.backward_next]
        return (e - s) * (1 + BACKWARD_COST)

    def groupable(self, max_tokens: int) -> bool:
        """Whether this pass's next slice is whole datums (it may share a slice with other runs'
        passes, grouped.py) rather than a chunk of a datum longer than `max_tokens`."""
        return not self.done and self.chunked is None and self.data[self.done_datums].num_tokens <= max_tokens

    def advance(self, max_tokens: int, point: Callable[[], None] | None = None) -> bool:
        """Run the datums that fit in `max_tokens` as one batch, or one chunk of a datum longer
        than that (chunked.py; `point`: its preemption point between attention blocks, for
        train/preempt.py); True once every datum ran. TrainingError if a loss or gradient is not
        finite (the run is left untouched)."""
        if self.groupable(max_tokens):
            failed = run_group(pick([self], max_tokens))
            if failed:
                raise failed[self]
        elif not self.done:
            self._chunk_step(max_tokens, point)
        return self.done

    def ran(self, datum: Datum, target_lp: Tensor, elementwise: Tensor) -> None:
        """A whole datum of this pass ran (its gradients, if any, already `accumulate`d)."""
        self.work += datum.num_tokens * (1 + BACKWARD_COST * self.backward)
        self._finish_datum(target_lp, elementwise)

    def _chunk_step(self, budget: int, point: Callable[[], None] | None) -> None:
        """One chunk of the current long datum (started here); the datum's outputs once its last ran."""
        if self.chunked is None:
            d, run = self.data[self.done_datums], self.run
            self.chunked = ChunkedDatum(run.model, run.factors, d.tokens, d.inputs, loss_spec(self.loss),
                                        self.loss_config, budget, self.backward,
                                        backward_budget=max(1, budget // (1 + BACKWARD_COST)))
        c = self.chunked
        backward = c.forward_done
        self.work += (c.step(point) if point else c.step()) * (1 + BACKWARD_COST if backward else 1)  # a backward chunk runs its forward again
        if c.forward_done and c.backward_next == len(c.back_bounds) - 1:  # forward just ended: check before any backward
            self._check_finite(c.elementwise.sum())
        if c.done:
            self.chunked = None
            if c.grads is not None:
                self.accumulate(c.grads)
            self._finish_datum(c.logprobs, c.elementwise)

    def _check_finite(self, loss: Tensor) -> None:
        if not math.isfinite(loss.item()):
            raise TrainingError(f"{self.loss} loss of datum {self.done_datums} is {loss.item()}: "
                                "the step failed and the run is unchanged")

    def _finish_datum(self, target_lp: Tensor, elementwise: Tensor) -> None:
        self.loss_sum += float(elementwise.detach().sum())
        self.outputs.append({"logprobs": target_lp.detach().float(), "elementwise_loss": elementwise.detach().float()})
        self.done_datums += 1

    def accumulate(self, grads: tuple[Tensor, ...]) -> None:
        if self.grads is None:
            self.grads = [g.detach().clone() for g in grads]
        else:
            for acc, g in zip(self.grads, grads):
                acc.add_(g)

    def finish(self) -> PassResult:
        """Hand the gradients to the run (checked finite first) and return the outputs."""
        if not self.done:
            raise RuntimeError("finish() before every datum ran")
        if self.grads is not None:
            bad = [i for i, g in enumerate(self.grads) if not bool(torch.isfinite(g).all())]
            if bad:
                raise TrainingError(f"non-finite gradient in {len(bad)} LoRA factor(s): the step failed "
                                    "and the run is unchanged")
            self.run._add_grads(self.grads)
        return PassResult(self.outputs, {"loss:sum": self.loss_sum})


class TrainingRun:
    """LoRA factors on the resident `model` (frozen, shared with serving), gradients, Adam state."""

    def __init__(self, model: CausalLM, config: RunConfig):
        self.model, self.config = model, config
        self.factors = LoRAFactors(model, config)
        self.grads: list[Tensor] | None = None
        self.optimizer = torch.optim.AdamW(self.factors.parameters(), lr=1e-4, foreach=False)
        self.steps = 0

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def start(self, data: list[Datum], loss: str, loss_config: Mapping[str, float] | None = None,
              *, backward: bool = True) -> Pass:
        """A pass over `data`, checked up front (TrainingError naming the bad datum)."""
        spec = loss_spec(loss)
        cfg = spec.config(loss, loss_config)
        if not data:
            raise TrainingError("no datums given")
        for i, datum in enumerate(data):
            self._check(i, datum, ("target_tokens", *spec.inputs))
        return Pass(self, data, loss, cfg, backward)

    def _check(self, i: int, datum: Datum, needed: tuple[str, ...]) -> None:
        n = datum.num_tokens
        if datum.tokens.dim() != 1 or n == 0:
            raise TrainingError(f"datum {i}: model_input must be a non-empty token list")
        missing = [k for k in needed if k not in datum.inputs]
        if missing:
            raise TrainingError(f"datum {i}: loss_fn_inputs lacks {missing}")
        for key, t in datum.inputs.items():
            if key not in needed:
                raise TrainingError(f"datum {i}: loss_fn_inputs has {key!r}, which this loss does not read")
            if tuple(t.shape) != (n,):
                raise TrainingError(f"datum {i}: {key} has shape {list(t.shape)}, model_input has {n} tokens")
        for key in ("tokens", "target_tokens"):
            t = datum.tokens if key == "tokens" else datum.inputs[key]
            if int(t.min()) < 0 or int(t.max()) >= self.vocab_size:
                raise TrainingError(f"datum {i}: {key} outside the vocabulary [0, {self.vocab_size})")

    def _add_grads(self, grads: list[Tensor]) -> None:
        if self.grads is None:
            self.grads = grads
        else:
            for acc, g in zip(self.grads, grads):
                acc.add_(g)

    @torch.no_grad()
    def optim_step(self, params: AdamParams, serving_dtype: torch.dtype | None = None) -> dict[str, float]:
        """One AdamW step on the accumulated gradients (none accumulated: a zero gradient, as
        Tinker's step then still decays and moves by the moments); gradients cleared after.

        Refused (TrainingError; the factors, moments, step count and gradients as they were) when
        the step size overflows float32 or the factors after it could not be served in
        `serving_dtype` (default: the base's): non-finite, or a gain past `catalog.bounds`'
        limit, the check every revision passes at import."""
        bias1 = 1 - params.beta1 ** (self.steps + 1)
        if params.learning_rate / bias1 > FLOAT32_MAX:
            raise TrainingError(f"adam_params.learning_rate {params.learning_rate:g}: the step size "
                                f"(learning_rate / (1 - beta1^{self.steps + 1}) = {params.learning_rate / bias1:.3g}) "
                                "overflows the float32 factors; the run is unchanged", param="learning_rate")
        ps = self.factors.parameters()
        grads = self.grads or [torch.zeros_like(p) for p in ps]
        kept = self._undo_point(grads)
        try:
            for p, g in zip(ps, grads):
                p.grad = g
            norm = torch.nn.utils.clip_grad_norm_(ps, params.grad_clip_norm) if params.grad_clip_norm > 0 \
                else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            for group in self.optimizer.param_groups:
                group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                             weight_decay=params.weight_decay)
            self.optimizer.step()
            self._check_bound(params, serving_dtype or self.model.model.embed_tokens.weight.dtype)
        except BaseException:
            self._undo(kept)
            raise
        finally:
            for p in ps:
                p.grad = None
        self.grads = None
        self.steps += 1
        return {"grad_norm:mean": float(norm)}

    def _undo_point(self, grads: list[Tensor]) -> tuple:
        """What a refused step puts back: copies of the factors, of each moment, and the
        gradients (clip_grad_norm_ scales them in place)."""
        ps = self.factors.parameters()
        state = {p: {k: v.clone() for k, v in self.optimizer.state[p].items()}
                 for p in ps if p in self.optimizer.state}
        return [p.detach().clone() for p in ps], state, [g.clone() for g in grads] if self.grads else None

    def _undo(self, kept: tuple) -> None:
        factors, state, grads = kept
        for p, saved in zip(self.factors.parameters(), factors):
            p.copy_(saved)
            if p in state:
                self.optimizer.state[p] = state[p]
            else:
                self.optimizer.state.pop(p, None)
        self.grads = grads

    def _check_bound(self, params: AdamParams, dtype: torch.dtype) -> None:
        """TrainingError unless every target's factors, as a revision saved now would hold them,
        pass the serving check: finite, within `dtype`, gain under its limit (catalog.bounds)."""
        name = str(dtype).removeprefix("torch.")
        limit = GAIN_LIMITS.get(name, GAIN_LIMITS["float32"])
        largest = float(torch.finfo(dtype).max) if dtype.is_floating_point else FLOAT32_MAX
        for path, gain, peak in self.factors.gains():
            if math.isfinite(gain) and gain <= limit and peak <= largest:
                continue
            what = ("holds NaN or Inf values" if not math.isfinite(gain) else
                    f"could scale an activation by {gain:.3g} (rank x max|B| x ||A||_inf), beyond the "
                    f"{limit:.0g} that {name} serving allows" if gain > limit else
                    f"holds values up to {peak:.3g}, beyond {name}'s range")
            raise TrainingError(
                f"optim_step refused: with learning_rate {params.learning_rate:g} the LoRA factors of "
                f"{path} {what}; such factors are never served (catalog.bounds). The run is unchanged "
                "(factors, Adam moments, step count and gradients): step again with a smaller "
                "learning_rate", param="learning_rate")

    def state_metadata(self) -> dict[str, str]:
        """What a training-state file says beside its tensors: the step count and the run's shape
        (`weights_info` reads it back without loading the tensors)."""
        cfg = self.config
        return {"steps": str(self.steps), "rank": str(cfg.rank), "alpha": str(cfg.alpha),
                "train_attn": str(cfg.train_attn), "train_mlp": str(cfg.train_mlp),
                "train_unembed": str(cfg.train_unembed)}

    def state_tensors(self) -> dict[str, Tensor]:
        """Training state by name: each factor and its two Adam moments (`.exp_avg`,
        `.exp_avg_sq`); the optimizer's step count is `steps` (saved beside, not a tensor)."""
        out = {}
        for name, p in self.factors.named_tensors().items():
            out[name] = p.detach()
            for moment, t in self.optimizer.state.get(p, {}).items():
                if moment != "step":
                    out[f"{name}.{moment}"] = t
        return out

    @torch.no_grad()
    def load_state(self, tensors: Mapping[str, Tensor], steps: int, *, optimizer: bool = True) -> None:
        """Put saved factors (and, with `optimizer`, Adam moments and step count) back; gradients
        in progress are dropped. ValueError if the state is not of a run shaped like this one."""
        names = self.factors.named_tensors()
        self.factors.load_named({k: v for k, v in tensors.items() if k in names})
        self.optimizer.state.clear()
        self.grads = None
        if not optimizer:
            return
        for name, p in names.items():
            moments = {m: tensors.get(f"{name}.{m}") for m in ("exp_avg", "exp_avg_sq")}
            if all(t is not None for t in moments.values()) and steps > 0:
                self.optimizer.state[p] = {"step": torch.tensor(float(steps)),
                                           **{m: t.clone() for m, t in moments.items()}}
        self.steps = steps
