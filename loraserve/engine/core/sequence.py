"""A request's state inside the engine. Plain Python: no tensors but its own RNG, and no text:
detokenization and stop strings belong to the API server's `OutputProcessor`."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..types import SamplingParams, TokenLogprob


class SeqStatus(enum.Enum):
    WAITING = "waiting"     # queued, adapter resident (or base only), not yet prefilled
    PARKED = "parked"       # waiting for its adapter to page in
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter_key: tuple[str, str] | None = None  # (adapter_id, revision) it runs on, fixed at arrival
    adapter_ref: str | None = None         # the model name asked for ("tenant/name[@rev]"; metrics)
    slot: int = -1                         # adapter pool slot while running; -1 = base only
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0                    # tokens whose K/V are in the cache
    num_scheduled: int = 0                 # prefill step: tokens to compute from num_cached on
    num_registered: int = 0                # leading full blocks registered in the prefix cache
    block_keys: list = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None    # first scheduled into a step (its queue time ends)
    first_token_time: float | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_emitted: int = 0                   # output tokens already handed to the caller
    adapter_record: object | None = None   # catalog RevisionRecord of adapter_key (to page it in)
    adapter_tier: str | None = None        # where adapter_key was on arrival (RequestOutput's)
    tenant: str = ""                       # whose request: the unit of fair share
    tenant_weight: float = 1.0             # the tenant's share relative to others (> 0)
    matcher: object | None = None          # structured output: its grammar's xgrammar matcher

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V are not computed yet: 1 for a sequence ready to decode, more while
        its prompt (or a preempted sequence's recompute) is still being prefilled in chunks."""
        return len(self) - self.num_cached

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; the next prefill recomputes prompt + outputs."""
        self.block_table = []
        self.num_cached = 0
        self.status = SeqStatus.WAITING
