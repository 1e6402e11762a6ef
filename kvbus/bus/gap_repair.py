"""Gap repair: how long a gap waits and which history is searched for its missing seqs.

`GapRepair` is the part of `kvbus.bus.sequencer.Sequencer` that keeps, per source waiting for
missing seqs, its deadline (``gap_timeout`` after the gap opened: the order of
``gapped``), whether its history search is still due, and how much history searches may
still read. It decides, and nothing else here does:

* **when a gap expires**: `GapRepair.next_deadline`, `GapRepair.expiring` (the time is
  the caller's ``now``; no clock is read);
* **which history is searched**: `GapRepair.search_history` plans one `HistorySearch`
  for every gap due, from the earliest anchor of the sources wanted to the newest
  message held back for them; `GapRepair.receive_history` keeps what it finds (only
  seqs still missing below the top held when the search began: at most once each);
* **how much**: searches read at most one history entry per entry read live, beyond
  ``repair_allowance`` (`GapRepair.read_live`), so repair costs O(1) per message
  amortized however many gaps a stream opens; a search is cut short when what is held
  back exceeds ``max_held_bytes`` (`kvbus.bus.hold_limits` then declares gaps lost early).

What it found is delivered by `kvbus.bus.delivery.Delivery`; a gap that expires unrepaired
is announced there too (one Resync for its missing seqs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

import msgspec

from kvbus.bus.source_state import Held, HeldBytes, SourceState
from kvbus.bus.subscription_stats import SubscriptionStats
from kvbus.logs import LimitedLog
from kvbus.transports import Position
from kvbus.wire.envelope import Envelope

REPAIR_ALLOWANCE: Final = 1 << 16
"""History entries a subscription's gap searches may read before it has read any entry
live; each entry read live allows one more, up to this many saved. So that searching
costs O(1) per message amortized, however many gaps a stream opens and however far
back. A search starts only when it may read a sixteenth of this (4,096) at least: a
backend fetches a page of history per round trip however few entries are wanted from
it, so under a flood of gaps there is at most one search per 4,096 entries read live."""


class HistorySearch(msgspec.Struct, gc=False):
    """Ask for history: the entries after ``after`` (None: from the oldest retained), in
    stream order, up to ``until`` and at most ``limit`` of them, each handed back to
    `Sequencer.receive_history` until it answers False; then `Sequencer.history_searched`."""

    after: Position | None
    until: Position | None
    limit: int
    wanted: dict[str, SourceState]
    tops: dict[str, int]
    """Each wanted source's highest held seq when the search began: what it looks below."""
    remaining: int
    """Seqs still missing below those tops: the search ends when none is."""
    read: int = 0


class GapRepair:
    """The open gaps, their deadlines and their history searches (see the module)."""

    def __init__(
        self,
        stats: SubscriptionStats,
        held_bytes: HeldBytes,
        *,
        gap_timeout: float,
        max_held_bytes: int,
        repair_allowance: int,
        stream: str,
        limited_log: LimitedLog,
    ) -> None:
        self.stats = stats
        self.held_bytes = held_bytes
        self.gap_timeout = gap_timeout
        self.max_held_bytes = max_held_bytes
        self.repair_allowance = repair_allowance
        self.stream = stream
        self._limited = limited_log
        self.gapped: OrderedDict[SourceState, None] = OrderedDict()
        """Sources waiting for missing seqs, in the order their gaps opened: that of
        their deadlines (each is ``gap_timeout`` after the opening)."""
        self.repair_due: set[SourceState] = set()
        """Those of ``gapped`` whose gap is new: not searched for yet."""
        self.repair_credit = repair_allowance
        """History entries a search may read now."""

    # --- gaps and their deadlines ------------------------------------------------------

    def open(self, state: SourceState, now: float) -> None:
        """``state`` holds messages back for a new gap: it expires ``gap_timeout`` from
        ``now``, and history is to be searched for it."""
        state.gap_deadline = now + self.gap_timeout
        self.gapped[state] = None
        self.repair_due.add(state)

    def close(self, state: SourceState) -> None:
        """``state``'s gap is filled, announced lost or obsolete (or it had none)."""
        state.gap_deadline = None
        self.gapped.pop(state, None)
        self.repair_due.discard(state)

    def next_deadline(self) -> float | None:
        """When the oldest open gap expires (None: no gap is open)."""
        if not self.gapped:
            return None
        return next(iter(self.gapped)).gap_deadline or 0.0

    def expiring(self, now: float, *, force: bool) -> list[SourceState]:
        """The gaps whose deadline passed (all with ``force``), the oldest first: search
        `unsearched` of them, substitute snapshots if any, then `declare_lost` each."""
        expired: list[SourceState] = []
        for state in self.gapped:
            if not force and (state.gap_deadline or 0.0) > now:
                break
            expired.append(state)
        return expired

    def unsearched(self, states: Iterable[SourceState]) -> list[SourceState]:
        """Those of ``states`` whose history search has not looked for every seq now missing."""
        return [s for s in states if s in self.repair_due or s.top > s.searched_top]

    # --- history searches --------------------------------------------------------------

    def read_live(self, entries: int) -> None:
        """``entries`` more were read live: each lets history searches read one more."""
        self.repair_credit = min(self.repair_allowance, self.repair_credit + entries)

    def search_history(
        self, states: Iterable[SourceState], read_position: Position | None
    ) -> HistorySearch | None:
        """One history search for the missing seqs of all ``states`` (None: none needed
        or allowed). It runs from the earliest of their anchors up to the newest message
        held back for them (``read_position`` if none: a missing seq is stored before the
        message that showed it missing, unless the store reordered them, and then the
        live read brings it), and ends as soon as nothing is missing."""
        states = list(states)
        self.repair_due.difference_update(states)
        wanted = {s.name: s for s in states if s.held}
        if not wanted:
            return None
        if self.repair_credit < self.repair_allowance // 16:
            self._repair_limited("skipped")
            return None
        remaining = 0
        for gapped in wanted.values():
            gapped.searched_top = gapped.top
            remaining += gapped.missing()
        tops = {name: s.top for name, s in wanted.items()}
        _, start = min((s.anchor for s in wanted.values()), key=lambda anchor: anchor[0])
        newest = [s.newest for s in wanted.values() if s.newest is not None]
        stop = max(newest, key=lambda held: held[0])[1] if newest else read_position
        return HistorySearch(start, stop, self.repair_credit, wanted, tops, remaining)

    def receive_history(
        self, search: HistorySearch, envelope: Envelope | None, position: Position
    ) -> bool:
        """An entry ``search`` read (its envelope if checked, else None); False: stop.
        A seq is kept only if still missing below the top the search began with, so
        each is held (then delivered) at most once, however often history repeats it."""
        search.read += 1
        state = search.wanted.get(envelope.source) if envelope is not None else None
        if envelope is not None and state is not None and envelope.epoch == state.epoch:
            seq = envelope.seq
            if state.seq < seq < search.tops[state.name] and seq not in state.held:
                state.hold(seq, Held(envelope, position, None, None))
                search.remaining -= 1
        if search.remaining <= 0 or position == search.until:
            return False
        if search.read >= search.limit or self.held_bytes.total > self.max_held_bytes:
            self._repair_limited("cut short")
            return False
        return True

    def searched(self, search: HistorySearch) -> None:
        """``search`` ended (or failed): what it read is spent."""
        self.repair_credit -= search.read
        self.stats.repair_entries += search.read

    def _repair_limited(self, what: str) -> None:
        self.stats.repairs_limited += 1
        self._limited.warning(
            "repair_limited",
            "kvbus: history search of %s %s: searches read at most one history entry per "
            "entry read live (beyond %d) and start only with %d to read; the gaps it did "
            "not search are declared lost when they expire",
            self.stream,
            what,
            self.repair_allowance,
            self.repair_allowance // 16,
        )


__all__ = ["REPAIR_ALLOWANCE", "GapRepair", "HistorySearch"]
