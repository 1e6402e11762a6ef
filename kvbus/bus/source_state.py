"""Per-source sequencing state for `kvbus.bus.sequencer.Sequencer`: where each source is,
what it holds back for a gap, and which sources are tracked (at most ``max_sources``)."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Final

import msgspec

from kvbus.transports import Position
from kvbus.wire.envelope import Envelope

_HELD_OVERHEAD: Final = 256
"""Bytes a held-back message is counted for beyond its payload (its envelope, its
entry in the held map and heap), so that ``max_held_bytes`` bounds many small ones too."""


class Held(msgspec.Struct, gc=False):
    envelope: Envelope
    position: Position
    order: int | None
    """Arrival order on the live read (None: found by a history search)."""
    previous: Position | None
    """Position of the live entry read just before this one."""


class HeldBytes:
    """Bytes held back for gaps by all the sources of one sequencer."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0


def _held_size(held: Held) -> int:
    return len(held.envelope.payload) + _HELD_OVERHEAD


class SourceState:
    """One source's place in its sequence, and what it holds back for a gap."""

    __slots__ = (
        "active",
        "anchor",
        "epoch",
        "gap_deadline",
        "held",
        "held_bytes",
        "held_seqs",
        "name",
        "newest",
        "position",
        "searched_top",
        "seq",
        "top",
    )

    def __init__(
        self,
        name: str,
        epoch: int,
        seq: int,
        position: Position | None,
        order: int,
        held_bytes: HeldBytes,
    ) -> None:
        self.name = name
        self.epoch = epoch
        self.seq = seq
        """The last seq delivered or declared lost."""
        self.position = position
        self.held: dict[int, Held] = {}
        """Messages above ``seq`` waiting for the seqs before them, by seq."""
        self.held_seqs: list[int] = []
        """The keys of ``held`` as a heap: its lowest in O(1) however many are held."""
        self.held_bytes = held_bytes
        self.top = 0
        """The highest seq held (while any is)."""
        self.newest: tuple[int, Position] | None = None
        """(arrival order, position) of the newest message held that the live read
        brought (while any is): where a history search for this gap can stop."""
        self.searched_top = 0
        """``top`` when history was last searched for this source's gap."""
        self.gap_deadline: float | None = None
        self.active = order
        """Arrival order of this source's newest message (for evicting the idlest)."""
        self.anchor: tuple[int, Position | None] = (order, position)
        """(arrival order, position) at or before ``position``: where a history search
        for this source's missing seqs starts (positions are opaque, orders compare)."""

    def hold(self, seq: int, held: Held) -> None:
        if not self.held:  # a new gap
            self.top, self.newest, self.searched_top = seq, None, 0
        self.held[seq] = held
        heapq.heappush(self.held_seqs, seq)
        self.held_bytes.total += _held_size(held)
        self.top = max(self.top, seq)
        if held.order is not None and (self.newest is None or held.order > self.newest[0]):
            self.newest = (held.order, held.position)

    def take_next(self) -> Held | None:
        """The held message of seq ``seq + 1``, if there is one (then the lowest held)."""
        held = self.held.pop(self.seq + 1, None)
        if held is not None:
            heapq.heappop(self.held_seqs)
            self.held_bytes.total -= _held_size(held)
        return held

    def lowest(self) -> int:
        return self.held_seqs[0]

    def drop_held_through(self, seq: int) -> None:
        while self.held_seqs and self.held_seqs[0] <= seq:
            self.held_bytes.total -= _held_size(self.held.pop(heapq.heappop(self.held_seqs)))

    def drop_held(self) -> None:
        self.held_bytes.total -= sum(_held_size(held) for held in self.held.values())
        self.held.clear()
        self.held_seqs.clear()

    def missing(self) -> int:
        """How many seqs are missing below the highest held one."""
        return self.top - self.seq - len(self.held) if self.held else 0


class SourceTable:
    """The sources tracked, at most ``max_sources``: beyond that the least recently
    active one is forgotten, approximately (the one longest in the queue that was not
    active since it was queued: a second-chance queue, O(1) amortized: a source is
    queued again only after a message of its own)."""

    def __init__(self, max_sources: int, held_bytes: HeldBytes) -> None:
        self.max_sources = max(1, max_sources)
        self.held_bytes = held_bytes
        self.states: dict[str, SourceState] = {}
        # Every tracked source once, with its `active` when queued: the front is the
        # least recently queued; one active since is queued again rather than evicted.
        self._queue: deque[tuple[int, SourceState]] = deque()

    def full(self) -> bool:
        return len(self.states) >= self.max_sources

    def track(
        self, name: str, epoch: int, seq: int, position: Position | None, order: int
    ) -> SourceState:
        state = self.states[name] = SourceState(name, epoch, seq, position, order, self.held_bytes)
        self._queue.append((order, state))
        return state

    def idlest(self) -> SourceState:
        """The source to forget next (still tracked: `forget` it)."""
        queue = self._queue
        while True:
            queued, state = queue.popleft()
            if self.states.get(state.name) is not state:
                continue  # forgotten already
            if state.active != queued:
                queue.append((state.active, state))
                continue
            return state

    def forget(self, state: SourceState) -> None:
        del self.states[state.name]
