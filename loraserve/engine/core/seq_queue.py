"""The scheduler's queues: sequences in order, each held once, with O(1) append at either end,
removal of any member and membership (an ordered set over an `OrderedDict`; `Sequence`
compares by identity). Plain Python, no tensors."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from .sequence import Sequence


class SeqQueue:
    """An ordered set of sequences. `append`, `appendleft`, `remove`, `discard`, `in`, `len`,
    `first` and `last` are O(1); `insert_by_arrival` is O(the members that arrived after the
    one inserted); iteration is in order."""

    __slots__ = ("_items",)

    def __init__(self, seqs: Iterable[Sequence] = ()):
        self._items: OrderedDict[Sequence, None] = OrderedDict()
        self.extend(seqs)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def __contains__(self, seq: object) -> bool:
        return seq in self._items

    def __repr__(self) -> str:
        return f"SeqQueue({[s.request_id for s in self._items]})"

    def append(self, seq: Sequence) -> None:
        """Put seq last; a sequence already queued is an error (it would lose its place)."""
        if seq in self._items:
            raise ValueError(f"sequence {seq.request_id} is already in the queue")
        self._items[seq] = None

    def appendleft(self, seq: Sequence) -> None:
        """Put seq first."""
        self.append(seq)
        self._items.move_to_end(seq, last=False)

    def extend(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.append(seq)

    def insert_by_arrival(self, seq: Sequence) -> None:
        """Put seq after the last member that arrived no later than it (in a queue in arrival
        order: where its arrival sorts, after equal ones), walking back from the end."""
        later = []
        for member in reversed(self._items):
            if member.arrival <= seq.arrival:
                break
            later.append(member)
        self.append(seq)
        for member in reversed(later):
            self._items.move_to_end(member)

    def remove(self, seq: Sequence) -> None:
        """Take seq out; ValueError when it is not in the queue."""
        if not self.discard(seq):
            raise ValueError(f"sequence {seq.request_id} is not in the queue")

    def discard(self, seq: Sequence) -> bool:
        """Take seq out if it is in the queue; whether it was."""
        return self._items.pop(seq, False) is None

    def first(self) -> Sequence:
        """The first member (IndexError when empty)."""
        for seq in self._items:
            return seq
        raise IndexError("first() of an empty queue")

    def last(self) -> Sequence:
        """The last member (IndexError when empty)."""
        for seq in reversed(self._items):
            return seq
        raise IndexError("last() of an empty queue")
