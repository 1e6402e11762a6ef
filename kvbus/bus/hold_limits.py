"""Hold limits: what a sequencer may keep, and the Resync that going over a limit costs.

`HoldLimits` is the part of `kvbus.bus.sequencer.Sequencer` that bounds its memory whatever
a stream does: at most ``max_sources`` sources tracked, at most ``max_held`` messages
held back for one source's gap, at most ``max_held_bytes`` held back for all gaps. It
decides, and nothing else here does, what gives way when a limit is passed, and it is
never a silent drop:

* too many held for one source (checked as each is held: `Sequencer.receive`), or too
  many bytes for all: the gap (the oldest gaps first, for bytes: their deadlines are
  the nearest) is declared lost early (`HoldLimits.declare_early`, `HoldLimits.shed`):
  a GAP or JOINED Resync for the seqs it waited for, then what it held is delivered;
* too many sources: the least recently active is forgotten (`HoldLimits.track`), after
  its gap, if any, is declared lost the same way; ``on_forget`` is told its name, and a
  source that comes back starts over with a JOINED Resync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvbus.bus.delivery import Delivery
from kvbus.bus.gap_repair import GapRepair
from kvbus.bus.source_state import HeldBytes, SourceState, SourceTable
from kvbus.bus.subscription_stats import SubscriptionStats
from kvbus.logs import LimitedLog, shown
from kvbus.transports import Position


class HoldLimits:
    """The sources tracked and the messages held back for their gaps, within their
    limits (see the module)."""

    def __init__(
        self,
        stats: SubscriptionStats,
        held_bytes: HeldBytes,
        gaps: GapRepair,
        delivery: Delivery[Any],
        *,
        max_sources: int,
        max_held_bytes: int,
        on_forget: Callable[[str], None] | None,
        stream: str,
        limited_log: LimitedLog,
    ) -> None:
        self.stats = stats
        self.held_bytes = held_bytes
        self.gaps = gaps
        self.delivery = delivery
        self.max_held_bytes = max_held_bytes
        self.on_forget = on_forget
        self.stream = stream
        self._limited = limited_log
        self.sources = SourceTable(max_sources, held_bytes)

    def track(
        self, name: str, epoch: int, seq: int, position: Position | None, order: int
    ) -> SourceState:
        """A new source's state, tracked (at ``seq``, as from a cursor or a snapshot); at
        most ``max_sources`` are."""
        if self.sources.full():
            self._evict_source()
        return self.sources.track(name, epoch, seq, position, order)

    def declare_early(self, state: SourceState, why: str) -> None:
        """Declare ``state``'s gap lost before its deadline: too much is held for it."""
        self.stats.gaps_declared_early += 1
        self._limited.warning(
            "declared_early",
            "kvbus: declared the gap of %s in %s lost before gap_timeout: %s",
            shown(state.name),
            self.stream,
            why,
        )
        self.delivery.declare_lost(state)

    def shed(self) -> None:
        """Declare the oldest gaps lost (their deadlines are the nearest) until what is
        held back for gaps fits in ``max_held_bytes`` again."""
        gapped = self.gaps.gapped
        while self.held_bytes.total > self.max_held_bytes and gapped:
            self.declare_early(
                next(iter(gapped)),
                f"{self.held_bytes.total} bytes held back for all gaps "
                f"(max_held_bytes={self.max_held_bytes})",
            )

    def held_messages(self) -> int:
        """Messages held back for all gaps."""
        return sum(len(s.held) for s in self.gaps.gapped)

    def held_arrivals(self) -> Iterator[tuple[int, Position | None]]:
        """(arrival order, previous position) of every message held back from the live read."""
        for state in self.sources.states.values():
            for held in state.held.values():
                if held.order is not None:
                    yield held.order, held.previous

    def _evict_source(self) -> None:
        """Forget the least recently active source (`SourceTable.idlest`). One holding
        messages back has its gap declared lost first, so that nothing it held goes
        unannounced. A source that comes back starts over with a JOINED resync."""
        state = self.sources.idlest()
        if state.held:
            self.delivery.declare_lost(state)
        self.sources.forget(state)
        if self.on_forget is not None:
            self.on_forget(state.name)
        self.stats.evicted_sources += 1
        self._limited.warning(
            "evicted",
            "kvbus: tracking more than max_sources=%d sources of %s: forgot the "
            "least recently active, %s",
            self.sources.max_sources,
            self.stream,
            shown(state.name),
        )


__all__ = ["HoldLimits"]
