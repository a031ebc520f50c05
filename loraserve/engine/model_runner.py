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
        lora.set_slots([a if a >= 0 and lora.pool.has_kind(a, "lm_head") else -1 for a in slots])

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
        """One forward. A prefill step computes `seq.num_scheduled` tokens of each sequence from
        `num_cached` on (a whole prompt, or a chunk of a long one); a decode step computes each
        sequence's last token. Logits come back for every sequence's last computed row; the
        engine samples only those whose tokens are all computed."""
        batch = self._order(seqs)
        ids, positions, starts, ends, rows = [], [], [], [], {}
        for seq in batch:
            if is_prefill:
                start = seq.num_cached
                end = start + seq.num_scheduled
                ids.extend(seq.all_ids[start:end])
            else:
                start, end = len(seq) - 1, len(seq)
                ids.extend(seq.output_ids[-1:] if seq.output_ids else seq.prompt_ids[-1:])
            rows[id(seq)] = (len(ids) - (end - start), start, end)  # first hidden row, positions
            positions.extend(range(start, end))
            starts.append(start)
            ends.append(end)
        dev = self.device
        attn = PagedAttention.build(self.cache, [s.block_table for s in batch], starts, ends, dev)
        if self.lora is not None:
            self.lora.set_slots([q.slot for q, s, e in zip(batch, starts, ends) for _ in range(e - s)])
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attn)
        last_rows, prompt_rows = [], {}
        for b, seq in enumerate(seqs):  # the caller's order from here on
            row, start, end = rows[id(seq)]
            last_rows.append(row + end - start - 1)
            if is_prefill and seq.wants_prompt_logprobs and start == 0:  # never chunked (scheduler)
                prompt_rows[b] = (row, row + len(seq.prompt_ids) - 1)
            seq.num_cached = end
        self._logit_slots([q.slot for q in seqs])
        logits = self.model.compute_logits(hidden[last_rows])
        prompt_logits = {}
        for b, (lo, hi) in prompt_rows.items():
            self._logit_slots([seqs[b].slot] * (hi - lo))
            prompt_logits[b] = self.model.compute_logits(hidden[lo:hi])
        return StepResult(logits.float(), prompt_logits)
