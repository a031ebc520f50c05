"""Runs one batch through the resident base: prepare inputs -> forward -> logits rows.

The runner reads sequences and writes none of their state: the engine advances them afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import KVCache, PagedAttention
from .decode_graphs import Padded
from .sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs, in the model's row order (see `ModelRunner._order`)."""

    batch: list[Sequence]                     # the sequences in model order
    token_ids: torch.Tensor                   # [T] int64
    positions: torch.Tensor                   # [T] int64
    attn: PagedAttention
    token_slots: list[int]                    # [T] adapter slot per token, -1 = base only
    rows: dict[int, tuple[int, int, int]]     # id(seq) -> (first hidden row, first position, end position)
    padded: Padded | None = None              # the same decode step padded to a compiled bucket


@dataclass(slots=True)
class StepResult:
    is_prefill: bool
    last_logits: torch.Tensor                   # [B, V] float32: next-token logits per sequence
    prompt_logits: dict[int, torch.Tensor]      # batch index -> [P-1, V] logits for prompt tokens 1..P-1
    picked: list[int] | None = None             # each row's argmax, once the engine's screen has read them


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.lora = None  # set by the engine when multi-LoRA is on (loraserve.lora.LoRAState)
        self.graphs = None  # DecodeGraphs when the decode step is compiled (engine.core.decode_graphs)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> StepResult:
        """One forward. A prefill step computes `seq.num_scheduled` tokens of each sequence from
        `num_cached` on (a whole prompt, or a chunk of a long one); a decode step computes each
        sequence's last token. Logits come back for every sequence's last computed row, in the
        caller's order; the engine samples only those whose tokens are all computed. A decode
        step that fits a compiled bucket runs through `graphs`, with the same results."""
        graphs = self.graphs
        if not is_prefill and graphs is not None:
            bucket = graphs.bucket(len(seqs), max(len(s) for s in seqs), any(s.slot >= 0 for s in seqs))
            # never waits: while a background compile holds the graphs, this step runs eagerly
            if bucket is not None and graphs.lock.acquire(blocking=False):
                try:
                    inputs = self.prepare(seqs, is_prefill, bucket)
                    hidden = graphs.forward(inputs.padded)
                finally:
                    graphs.lock.release()
                return self.logits(seqs, inputs, hidden, is_prefill)
        inputs = self.prepare(seqs, is_prefill)
        hidden = self.forward(inputs)
        return self.logits(seqs, inputs, hidden, is_prefill)

    def prepare(self, seqs: list[Sequence], is_prefill: bool,
                bucket: tuple[int, int] | None = None) -> StepInputs:
        """The step's inputs in model order; with a decode `bucket`, also padded to it."""
        batch = self._order(seqs)
        ids, positions, starts, ends, slots, rows = [], [], [], [], [], {}
        for seq in batch:
            if is_prefill:
                start = seq.num_cached
                end = start + seq.num_scheduled
                ids.extend(seq.all_ids[start:end])
            else:
                start, end = len(seq) - 1, len(seq)
                ids.extend(seq.output_ids[-1:] if seq.output_ids else seq.prompt_ids[-1:])
            rows[id(seq)] = (len(ids) - (end - start), start, end)
            positions.extend(range(start, end))
            slots.extend([seq.slot] * (end - start))
            starts.append(start)
            ends.append(end)
        dev = self.device
        tables = [s.block_table for s in batch]
        if bucket is not None:
            padded = self.graphs.pad(ids, positions, slots, tables, ends, bucket)
            return StepInputs(batch, padded.token_ids, padded.positions, padded.attn, slots, rows,
                              padded)
        attn = PagedAttention.build(self.cache, tables, starts, ends, dev)
        return StepInputs(batch, torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                          attn, slots, rows)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, H] of the step's tokens, in model order."""
        if self.lora is not None:
            self.lora.set_slots(inputs.token_slots)
        return self.model(inputs.token_ids, inputs.positions, inputs.attn)

    def logits(self, seqs: list[Sequence], inputs: StepInputs, hidden: torch.Tensor,
               is_prefill: bool) -> StepResult:
        """Next-token logits of each sequence's last row, and prompt logits where asked."""
        last_rows, prompt_rows = [], {}
        for b, seq in enumerate(seqs):  # the caller's order from here on
            row, start, end = inputs.rows[id(seq)]
            last_rows.append(row + end - start - 1)
            if is_prefill and seq.wants_prompt_logprobs and start == 0:  # never chunked (scheduler)
                prompt_rows[b] = (row, row + len(seq.prompt_ids) - 1)
        self._logit_slots([q.slot for q in seqs])
        # a decode step's last rows are all of hidden, in order: no gather (a copy) then
        whole = len(last_rows) == hidden.shape[0] and last_rows == list(range(len(last_rows)))
        logits = self.model.compute_logits(hidden if whole else hidden[last_rows])
        prompt_logits = {}
        for b, (lo, hi) in prompt_rows.items():
            self._logit_slots([seqs[b].slot] * (hi - lo))
            prompt_logits[b] = self.model.compute_logits(hidden[lo:hi])
        return StepResult(is_prefill, logits.float(), prompt_logits)

    def _order(self, seqs: list[Sequence]) -> list[Sequence]:
        """The order the model sees the batch in. With LoRA on, sequences are grouped by adapter
        slot (ascending, base-only last: the order `LoRAMeta.build` sorts tokens into), so every
        LoRA segment is a contiguous run of rows and the ops read x and write y as views, with
        no token gather or scatter. Results are returned in the caller's order."""
        if self.lora is None:
            return seqs
        return sorted(seqs, key=lambda q: q.slot if q.slot >= 0 else 1 << 62)

    def _logit_slots(self, slots: list[int]) -> None:
        """Slots for the rows compute_logits sees. Only an lm_head LoRA reads them: the pass
        skips LoRA entirely when no sequence of the batch has one."""
        lora = self.lora
        if lora is None or not lora.covers_lm_head:
            return
        lora.set_slots([a if a >= 0 and lora.pool.has_kind(a, "lm_head") else -1 for a in slots])
