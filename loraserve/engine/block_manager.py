"""Paged KV cache bookkeeping: which fixed-size blocks each sequence owns. No tensors here."""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    """Hands out KV blocks of `block_size` tokens from a fixed pool of `num_blocks`.

    A sequence of n tokens owns ceil(n / block_size) blocks; its token i lives in
    block_table[i // block_size] at offset i % block_size.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Grow seq's block table to hold all len(seq) tokens."""
        need = self.blocks_needed(len(seq)) - len(seq.block_table)
        if need > len(self._free):
            raise RuntimeError("KV cache exhausted (caller must check can_allocate)")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def can_append(self, seq: Sequence) -> bool:
        """One more token fits: either room in the last block or a free block."""
        return len(seq) <= len(seq.block_table) * self.block_size or len(self._free) > 0

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0
