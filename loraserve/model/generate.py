"""Greedy decoding by full recompute: the reference the engine's cached decoding must match."""
from __future__ import annotations

import torch

from loraserve.model.transformer import CausalLM


@torch.no_grad()
def greedy_generate(model: CausalLM, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_ids: list[int] | None = None) -> list[int]:
    """Append argmax tokens to `prompt_ids`, recomputing the whole sequence every step.

    Returns only the new ids; stops after (and including) the first id in `eos_token_ids`."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    stop = set(eos_token_ids or [])
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        t = torch.tensor(ids, dtype=torch.long, device=device)
        hidden = model(t, torch.arange(len(ids), device=device))     # [T, H]
        token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        ids.append(token)
        new.append(token)
        if token in stop:
            break
    return new
