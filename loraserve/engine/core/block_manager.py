"""Paged KV cache bookkeeping: which fixed-size blocks each sequence owns. No tensors here.

Automatic prefix caching. A *full* block whose K/V have been computed is registered under a key
that chains the keys of every block before it, the block's own token ids and the adapter
revision the sequence runs on (an adapter changes K/V from the first layer on, so each adapter
revision, and the base, has its own namespace). A new sequence takes the registered blocks of
its longest cached prefix (reference-counted, never written again) and computes only the rest.
Blocks nobody references keep their contents and stay findable until a fresh block is needed:
then the least recently released one is reused.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from .sequence import Sequence


class BlockManager:
    """Hands out KV blocks of `block_size` tokens from a fixed pool of `num_blocks`.

    A sequence of n tokens owns ceil(n / block_size) blocks; its token i lives in
    block_table[i // block_size] at offset i % block_size.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # no contents worth keeping; a heap, lowest block first: one sequence at a time gets
        # consecutive blocks, which attention reads as a slice of the cache instead of a gather
        self._free: list[int] = list(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}               # registered block -> its key
        self._block_of: dict[Hashable, int] = {}             # key -> registered block
        self._idle: OrderedDict[int, None] = OrderedDict()   # registered, unreferenced; LRU first
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0    # of which found cached

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take: never used, or cached but unreferenced."""
        return len(self._free) + len(self._idle)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Grow seq's block table to hold all len(seq) tokens. A sequence with no blocks yet
        first takes its longest cached prefix and starts computing after it (`num_cached`)."""
        if not seq.block_table and seq.num_cached == 0 and self.prefix_caching:
            self._take_cached_prefix(seq)
        need = self.blocks_needed(len(seq)) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError("KV cache exhausted (caller must check can_allocate)")
        for _ in range(need):
            block = self._fresh()
            self._refs[block] = 1
            seq.block_table.append(block)

    def can_append(self, seq: Sequence) -> bool:
        """One more token fits: either room in the last block or a free block."""
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free > 0

    def commit(self, seqs: Iterable[Sequence]) -> None:
        """After a step: register the blocks these sequences have just filled and computed."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for seq in seqs:
            full = min(seq.num_cached // bs, len(seq.block_table))
            if full <= seq.num_registered:
                continue
            keys = self._keys(seq, full)
            for i in range(seq.num_registered, full):
                block, key = seq.block_table[i], keys[i]
                if key not in self._block_of and block not in self._key_of:
                    self._block_of[key] = block
                    self._key_of[block] = key
            seq.num_registered = full

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Its registered blocks stay cached (tail blocks are reused
        first, so a shared prefix outlives the suffixes hanging off it)."""
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._idle[block] = None
                else:
                    heapq.heappush(self._free, block)
        seq.block_table = []
        seq.num_cached = 0
        seq.num_registered = 0

    def discard(self, seq: Sequence) -> list[int]:
        """Free seq's blocks as `free` does, but first take every one of them out of the prefix
        cache, so no later sequence finds what seq wrote (a sequence whose numbers went
        non-finite). Returns the blocks now referenced by nobody, for the caller to scrub."""
        for block in seq.block_table:
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
        orphans = [block for block in seq.block_table if self._refs[block] == 1]
        self.free(seq)
        return orphans

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the books balance against the live sequences `seqs` (tests): every block is
        exactly one of free, idle (cached, unreferenced) or referenced, with the right count."""
        refs = [0] * self.num_blocks
        for seq in seqs:
            for block in seq.block_table:
                refs[block] += 1
            assert seq.num_cached <= len(seq.block_table) * self.block_size, seq.request_id
        assert refs == self._refs, "reference counts disagree with the block tables"
        free, idle = set(self._free), set(self._idle)
        assert len(free) == len(self._free) and not free & idle, "a block is listed twice"
        for block in range(self.num_blocks):
            state = (block in free) + (block in idle) + (refs[block] > 0)
            assert state == 1, f"block {block} is in {state} states"
            assert block not in free or block not in self._key_of, f"free block {block} is registered"
        assert idle <= self._key_of.keys(), "an idle block is not registered"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "the key maps disagree"
        assert len(self._block_of) == len(self._key_of)

    # -- internals ----------------------------------------------------------------------------
    def _keys(self, seq: Sequence, n: int) -> list[Hashable]:
        """Chained keys of seq's first n full blocks (memoised on the sequence: its tokens only
        grow, and a block's key depends on nothing after it)."""
        keys = seq.block_keys
        if len(keys) >= n:
            return keys
        bs, ids = self.block_size, seq.all_ids
        parent = hash(keys[-1]) if keys else hash(("loraserve-prefix", seq.adapter_key))
        for i in range(len(keys), n):
            key = (parent, tuple(ids[i * bs:(i + 1) * bs]))
            keys.append(key)
            parent = hash(key)
        return keys

    def _take_cached_prefix(self, seq: Sequence) -> None:
        if seq.wants_prompt_logprobs:  # every prompt position must be computed for its logits
            return
        # full blocks strictly before the last token: at least one token is always computed,
        # and it lands in a fresh block, so a shared block is never written
        n = (len(seq) - 1) // self.block_size
        self.prefix_query_tokens += len(seq.prompt_ids)
        hits = 0
        for key in self._keys(seq, n)[:n]:
            block = self._block_of.get(key)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1
            seq.block_table.append(block)
            hits += 1
        seq.num_registered = hits
        seq.num_cached = hits * self.block_size
        self.prefix_hit_tokens += min(seq.num_cached, len(seq.prompt_ids))

    def _fresh(self) -> int:
        """A block to write into: a never-registered one first, else the LRU idle cached one."""
        if self._free:
            return heapq.heappop(self._free)
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block
