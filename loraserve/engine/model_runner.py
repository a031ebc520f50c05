"""Runs one batch through the resident base: inputs -> paged attention -> logits rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import KVCache, PagedAttention
from .sequence import Sequence


@dataclass(slots=True)
class StepResult:
    last_logits: torch.Tensor                   # [B, V] float32: next-token logits per sequence
    prompt_logits: dict[int, torch.Tensor]      # batch index -> [P-1, V] logits for prompt tokens 1..P-1


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.lora = None  # set by the engine when multi-LoRA is on (loraserve.lora.LoRAState)

    def _logit_slots(self, slots: list[int]) -> None:
        """Slots for the rows compute_logits sees. Only an lm_head LoRA reads them: the pass
        skips LoRA entirely when no sequence of the batch has one."""
        lora = self.lora
        if lora is None or not lora.covers_lm_head:
            return
        slots = [a if a >= 0 and lora.pool.has_kind(a, "lm_head") else -1 for a in slots]
        if max(slots, default=-1) < 0:
            lora.meta = None  # the common case: no lm_head LoRA in this batch
        else:
            lora.set_slots(slots)

    def _order(self, seqs: list[Sequence]) -> list[Sequence]:
        """The order the model sees the batch in. With LoRA on, sequences are grouped by adapter
        slot (ascending, base-only last: the order `LoRAMeta.build` sorts tokens into), so every
        LoRA segment is a contiguous run of rows and the ops read x and write y as views, with
        no token gather or scatter. Results are returned in the caller's order."""
        if self.lora is None:
            return seqs
        return sorted(seqs, key=lambda q: q.slot if q.slot >= 0 else 1 << 62)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> StepResult:
        batch = self._order(seqs)
        ids, positions, starts, ends, rows = [], [], [], [], {}
        for seq in batch:
            start = seq.num_cached if is_prefill else len(seq) - 1
            rows[id(seq)] = (len(ids), start)  # first hidden row, first position
            ids.extend(seq.all_ids[start:] if is_prefill else seq.output_ids[-1:])
            positions.extend(range(start, len(seq)))
            starts.append(start)
            ends.append(len(seq))
        dev = self.device
        attn = PagedAttention.build(self.cache, [s.block_table for s in batch], starts, ends, dev)
        if self.lora is not None:
            self.lora.set_slots([q.slot for q, s, e in zip(batch, starts, ends) for _ in range(e - s)])
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attn)
        last_rows, prompt_rows = [], {}
        for b, seq in enumerate(seqs):  # the caller's order from here on
            row, start = rows[id(seq)]
            last_rows.append(row + len(seq) - start - 1)
            if is_prefill and seq.wants_prompt_logprobs and start == 0:
                prompt_rows[b] = (row, row + len(seq.prompt_ids) - 1)
            seq.num_cached = len(seq)
        self._logit_slots([q.slot for q in seqs])
        logits = self.model.compute_logits(hidden[last_rows])
        prompt_logits = {}
        for b, (lo, hi) in prompt_rows.items():
            self._logit_slots([seqs[b].slot] * (hi - lo))
            prompt_logits[b] = self.model.compute_logits(hidden[lo:hi])
        return StepResult(logits.float(), prompt_logits)
