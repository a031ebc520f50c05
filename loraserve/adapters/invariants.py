"""Consistency checks of an AdapterPool's bookkeeping, for tests (`AdapterPool.check_invariants`).

Raises AssertionError naming the first broken rule: adapters <= slots, pool bytes <= max_bytes,
every slot and every row of every kind owned by at most one adapter or free (never both, never
lost), and the device-side `row_table` / `ranks` agreeing with the host-side owner records.
"""
from __future__ import annotations


def check_pool(pool, entries: dict, slot_keys: list, free_slots: list[int],
               free_rows: dict[str, list[int]]) -> None:
    """Assert the invariants of `pool`, given its private owner records (on the thread that owns
    the pool: it has no lock)."""
    cfg = pool.config
    assert len(entries) <= cfg.max_slots, "more resident adapters than slots"
    if cfg.max_bytes is not None:
        assert pool.bytes_capacity <= cfg.max_bytes, "pool larger than max_bytes"
    used = {e.slot for e in entries.values()}
    assert len(used) == len(entries), "two adapters share a slot"
    assert used.isdisjoint(free_slots), "a slot is both used and free"
    assert len(used) + len(free_slots) == cfg.max_slots, "a slot was lost"
    for key, entry in entries.items():
        assert slot_keys[entry.slot] == key, "slot table out of sync"
        assert entry.refcount >= 0 and 1 <= entry.rank <= cfg.max_rank, f"{key}: bad refcount/rank"
    for kind in pool.specs:
        _check_kind(pool, kind, entries, slot_keys, free_rows[kind])


def _check_kind(pool, kind: str, entries: dict, slot_keys: list, free: list[int]) -> None:
    owned = [r for e in entries.values() for r in e.rows.get(kind, ())]
    assert len(set(owned)) == len(owned), f"{kind}: a row is owned twice"
    assert set(owned).isdisjoint(free) and len(set(free)) == len(free), f"{kind}: free list corrupt"
    assert len(owned) + len(free) == pool.rows_per_kind, f"{kind}: a row was lost"
    ranks = pool.ranks[kind].cpu()
    table = pool.row_table[kind].cpu()
    for slot, key in enumerate(slot_keys):
        rows = entries[key].rows.get(kind) if key is not None else None
        assert int(ranks[slot]) == (len(rows) if rows else 0), f"{kind}: ranks[{slot}] stale"
        if rows:
            assert table[slot, : len(rows)].tolist() == rows, f"{kind}: row_table[{slot}] stale"
