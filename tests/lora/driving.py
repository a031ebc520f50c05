"""Running an engine's requests to completion in tests, collecting what each one got."""
from __future__ import annotations

import time
from collections.abc import Callable


def drive(eng, reqs, *, after_add: Callable[[], None] | None = None,
          max_steps: int = 2000) -> dict[str, tuple]:
    """Add `reqs`, call `after_add`, step until idle; request id -> (token ids, error or None).
    While only page-ins are pending, the loop yields a millisecond to the pager threads."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    errors: dict[str, Exception | None] = {r.request_id: None for r in reqs}
    for r in reqs:
        eng.add_request(r)
    if after_add is not None:
        after_add()
    for _ in range(max_steps):
        if not eng.has_work():
            break
        for out in eng.step():
            tokens[out.request_id] += out.token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
        if not eng.scheduler.has_work:
            time.sleep(0.001)  # parked on a page-in: let the pager run
    assert not eng.has_work() and not eng.seqs
    return {rid: (tokens[rid], errors[rid]) for rid in tokens}
