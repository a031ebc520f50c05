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

    @torch.inference_mode()
    def _logit_slots(self, slots: list[int]) -> None:
        """Slots for the rows compute_logits sees; only an lm_head LoRA reads them."""
        if self.lora is not None and self.lora.covers_lm_head:
            self.lora.set_slots(slots)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> StepResult:
        ids, positions, starts, ends = [], [], [], []
        for seq in seqs:
            start = seq.num_cached if is_prefill else len(seq) - 1
            ids.extend(seq.all_ids[start:] if is_prefill else seq.output_ids[-1:])
            positions.extend(range(start, len(seq)))
            starts.append(start)
            ends.append(len(seq))
        dev = self.device
        attn = PagedAttention.build(self.cache, [s.block_table for s in seqs], starts, ends, dev)
        if self.lora is not None:
            self.lora.set_slots([q.slot for q, s, e in zip(seqs, starts, ends) for _ in range(e - s)])
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attn)
        last_rows, prompt_rows, row = [], {}, 0
        for b, (seq, s, e) in enumerate(zip(seqs, starts, ends)):
            last_rows.append(row + e - s - 1)
            if is_prefill and seq.wants_prompt_logprobs and s == 0:
                prompt_rows[b] = (row, row + len(seq.prompt_ids) - 1)
            row += e - s
        for seq, s, e in zip(seqs, starts, ends):
            seq.num_cached = e
        self._logit_slots([q.slot for q in seqs])
        logits = self.model.compute_logits(hidden[last_rows])
        prompt_logits = {}
        for b, (lo, hi) in prompt_rows.items():
            self._logit_slots([seqs[b].slot] * (hi - lo))
            prompt_logits[b] = self.model.compute_logits(hidden[lo:hi])
        return StepResult(logits.float(), prompt_logits)
