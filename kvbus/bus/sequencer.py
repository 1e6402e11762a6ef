"""The delivery guarantees as a pure state machine: no transport, no event loop, no clock.

`Sequencer` is to `kvbus.bus.subscription.Subscription` what h11's ``Connection`` is to a
socket: the subscription reads pages, checks envelopes and trust, and feeds the
sequencer what it may consider (`Sequencer.receive`); the sequencer decides, per source,
what is delivered and in which order, which `Resync` is announced, and which history is
searched for missing seqs; the subscription carries that out and hands the items on.
Time is an argument (``now``: a monotonic clock's reading), never read here, so every
decision can be replayed (tests/test_sequencer_properties.py drives it alone).

What it is fed:

* `Sequencer.receive`: a checked envelope read live, with its arrival order, the
  position read before it and ``now``; `Sequencer.advance` instead, for a source's
  next seq with no gap open (the fast path: `kvbus.bus.intake.PageIngest` checks, inline
  per entry, the rule `Sequencer.accept_run` states for a run);
* `Sequencer.read_live`: how many entries were read live (what history may cost);
* `Sequencer.receive_history`: each entry a `HistorySearch` read, then
  `Sequencer.history_searched` (no live entry is fed while a search is open: a source
  forgotten meanwhile would leave the search holding messages for no state);
* `Sequencer.declare_lost` for each gap `Sequencer.expiring` gave at ``now``, or
  `Sequencer.substitute` for one a snapshot covers (`Sequencer.snapshot_covers`).

What it answers with:

* `Sequencer.ready`: the items to hand out, in order, each a message (made by the
  ``open_message`` it was given) or a `Resync`, with the arrival order of the entry that
  brought it and the position read just before that entry (None for neither: for
  `kvbus.bus.subscription.Cursor`);
* `Sequencer.search_history`: a `HistorySearch` (read history after ``after``, up to
  ``until``, at most ``limit`` entries) for new (``repair_due``) or expiring gaps;
* `Sequencer.next_deadline`: when the oldest gap expires.

The guarantees, and where each is decided (the module docstring of `kvbus.subscribe`
tells them to a consumer):

* **at most once, in order, per source**: a seq at or below the source's last one, or
  already held, is a duplicate (`Sequencer.receive`; a history find likewise:
  `kvbus.bus.gap_repair.GapRepair.receive_history`); a message is delivered only as the
  next seq (`kvbus.bus.delivery.Delivery.release`);
* **every missing seq repaired or announced by exactly one Resync**: a skipped seq is
  held back for while history is searched (`kvbus.bus.gap_repair`), then declared lost (GAP,
  or JOINED for a source first seen mid-epoch); a gap marker or a loss notice announces
  DROPPED seqs at once; a new epoch is a NEW_EPOCH, and older epochs are stale
  (`kvbus.bus.delivery`). Missing seqs are a range, never a set;
* **bounded, never a silent drop**: one source holds at most ``max_held`` messages back,
  all at most ``max_held_bytes`` (then the oldest gaps are declared lost early); at most
  ``max_sources`` are tracked (the least recently active is forgotten, its gap declared
  lost first) (`kvbus.bus.hold_limits`); history searches read at most one entry per entry
  read live beyond ``repair_allowance`` (`kvbus.bus.gap_repair`).

Per-source state is `kvbus.bus.source_state.SourceState`; `Sequencer` only routes what it is
fed to those parts, and keeps the per-message paths (`receive`, `accept_run`,
`advance`) here, with no call between them and the state they change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final, Generic

from kvbus.bus.delivery import Delivery, MessageT, Outcome, Ready, Resync, ResyncReason
from kvbus.bus.gap_repair import REPAIR_ALLOWANCE, GapRepair, HistorySearch
from kvbus.bus.hold_limits import HoldLimits
from kvbus.bus.source_state import Held, HeldBytes, SourceState
from kvbus.bus.subscription_stats import SubscriptionStats
from kvbus.logs import LimitedLog
from kvbus.transports import Position
from kvbus.wire.envelope import Envelope

log = logging.getLogger("kvbus.bus.subscription")
_limited = LimitedLog(log)

MAX_HELD: Final = 1 << 16
"""Messages held back for one source's gap before the gap is declared lost at once."""


class Sequencer(Generic[MessageT]):
    """Per-source ordering, gap bookkeeping and loss announcement (see the module): a
    facade over `Delivery` (order and Resyncs), `GapRepair` (deadlines and history
    searches) and `HoldLimits` (what may be held and tracked)."""

    def __init__(
        self,
        open_message: Callable[[Envelope, Position], MessageT | Outcome],
        stats: SubscriptionStats,
        *,
        gap_timeout: float,
        max_sources: int,
        max_held_bytes: int,
        max_held: int = MAX_HELD,
        repair_allowance: int = REPAIR_ALLOWANCE,
        on_forget: Callable[[str], None] | None = None,
        stream: str = "",
        limited_log: LimitedLog = _limited,
    ) -> None:
        self.stats = stats
        self.gap_timeout = gap_timeout
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.held_bytes = HeldBytes()
        """Bytes held back for all gaps (``max_held_bytes``)."""
        gaps = self._gaps = GapRepair(
            stats,
            self.held_bytes,
            gap_timeout=gap_timeout,
            max_held_bytes=max_held_bytes,
            repair_allowance=repair_allowance,
            stream=stream,
            limited_log=limited_log,
        )
        delivery = self._delivery = Delivery(
            open_message, stats, gaps, stream=stream, limited_log=limited_log
        )
        limits = self._limits = HoldLimits(
            stats,
            self.held_bytes,
            gaps,
            delivery,
            max_sources=max_sources,
            max_held_bytes=max_held_bytes,
            on_forget=on_forget,
            stream=stream,
            limited_log=limited_log,
        )
        self.sources = limits.sources
        self.states = limits.sources.states
        """The sources tracked, by name."""
        self.ready: Ready[MessageT] = delivery.ready
        self.gapped = gaps.gapped
        """Sources waiting for missing seqs, the oldest gap first."""
        self.repair_due = gaps.repair_due
        """Sources whose new gap awaits its history search (`search_history`)."""
        # The collaborators' methods, bound once: no call more than before the split.
        # Fed:
        self.read_live = gaps.read_live
        self.receive_history = gaps.receive_history
        self.declare_lost = delivery.declare_lost
        self.substitute = delivery.substitute
        self.track = limits.track
        # Asked:
        self.next_deadline = gaps.next_deadline
        self.expiring = gaps.expiring
        self.unsearched = gaps.unsearched
        self.search_history = gaps.search_history
        self.snapshot_covers = delivery.snapshot_covers
        self.held_messages = limits.held_messages
        self.held_arrivals = limits.held_arrivals
        self._release = delivery.release

    def receive(
        self,
        envelope: Envelope,
        position: Position,
        order: int,
        previous: Position | None,
        now: float,
    ) -> None:
        """A checked envelope read live (the ``order``-th entry, after ``previous``):
        stale, a duplicate, delivered (with what it unblocks), or held back for a gap;
        a gap opens with a deadline of ``now`` + ``gap_timeout``, and is declared lost at
        once if that is 0 or more is held back than ``max_held`` / ``max_held_bytes``."""
        source = envelope.source
        state = self.states.get(source)
        # A first message that is not seq 1 is an ordinary gap: the earlier seqs may
        # still arrive (reordered) or be in history; JOINED is declared only on expiry.
        if state is None:
            state = self.track(source, envelope.epoch, 0, previous, order - 1)
        elif envelope.epoch < state.epoch:
            self.stats.stale += 1
            return
        elif envelope.epoch > state.epoch:
            self._delivery.new_epoch(state, envelope.epoch, order, previous)
        state.active = order
        if envelope.seq <= state.seq or envelope.seq in state.held:
            self.stats.duplicates += 1
            return
        state.hold(envelope.seq, Held(envelope, position, order, previous))
        self._release(state)
        if not state.held:
            return
        if self.gap_timeout <= 0:
            self.declare_lost(state)
        elif len(state.held) > self.max_held:
            self._limits.declare_early(state, f"{len(state.held)} messages held back")
        elif state.gap_deadline is None:
            self._gaps.open(state, now)
        if self.held_bytes.total > self.max_held_bytes:
            self._limits.shed()

    def accept_run(self, source: str, epoch: int, first: int, last: int) -> SourceState | None:
        """The state of ``source`` if seqs ``first..last`` of ``epoch`` are its next ones
        with no gap open: then they may be delivered as they are, without `receive`
        (the caller advances the state: `advance`). The fast path's one check per run."""
        state = self.states.get(source)
        if state is None or first != state.seq + 1 or epoch != state.epoch or state.held:
            return None
        return state

    @staticmethod
    def advance(state: SourceState, seq: int, order: int, position: Position) -> None:
        """``state`` after its next message, ``seq``, delivered as the ``order``-th entry."""
        state.seq = seq
        state.position = position
        state.anchor = (order, position)
        state.active = order

    def start_at(
        self, name: str, epoch: int, seq: int, position: Position | None, message: MessageT
    ) -> None:
        """Begin ``name`` at its snapshot (seq ``seq``), delivered as ``message``."""
        self.track(name, epoch, seq, position, -1)
        self.stats.snapshots += 1
        self.ready.append((message, None, None))

    def history_searched(self, search: HistorySearch) -> None:
        """``search`` ended (or failed): deliver what it found; if that leaves more held
        back than ``max_held_bytes``, the oldest gaps are declared lost early."""
        self._gaps.searched(search)
        for state in search.wanted.values():
            self._release(state)
        if self.held_bytes.total > self.max_held_bytes:
            self._limits.shed()

    @property
    def repair_credit(self) -> int:
        """History entries a search may read now (`kvbus.bus.gap_repair.REPAIR_ALLOWANCE`)."""
        return self._gaps.repair_credit


__all__ = [
    "MAX_HELD",
    "REPAIR_ALLOWANCE",
    "HistorySearch",
    "Outcome",
    "Resync",
    "ResyncReason",
    "Sequencer",
    "SourceState",
    "SubscriptionStats",
]
