"""The delivery guarantees as a pure state machine: no transport, no event loop, no clock.

`Sequencer` is to `kvbus.subscribe.Subscription` what h11's ``Connection`` is to a
socket: the subscription reads pages, checks envelopes and trust, and feeds the
sequencer what it may consider (`Sequencer.receive`); the sequencer decides, per source,
what is delivered and in which order, which `Resync` is announced, and which history is
searched for missing seqs; the subscription carries that out and hands the items on.
Time is an argument (``now``: a monotonic clock's reading), never read here, so every
decision can be replayed (tests/test_sequencer_properties.py drives it alone).

What it answers with:

* `Sequencer.ready`: the items to hand out, in order, each a message (made by the
  ``open_message`` it was given) or a `Resync`, with the arrival order of the entry that
  brought it and the position read just before that entry (None for neither: for
  `kvbus.subscribe.Cursor`);
* `Sequencer.search_history`: a `HistorySearch` (read history after ``after``, up to
  ``until``, at most ``limit`` entries) for new or expiring gaps; each entry read goes back
  through `Sequencer.receive_history`, and `Sequencer.history_searched` ends it;
* `Sequencer.next_deadline`: when the oldest gap expires (then `Sequencer.expire`).

The rules (the module docstring of `kvbus.subscribe` tells them to a consumer): a skipped
seq is held back while history is searched, then declared lost (GAP, or JOINED for a
source first seen mid-epoch); a gap marker or a loss notice announces DROPPED seqs at
once; a new epoch is a NEW_EPOCH, and older epochs are stale. Missing seqs are a range,
never a set; one source holds at most ``max_held`` messages back, all at most
``max_held_bytes`` (then the oldest gaps are declared lost early); at most
``max_sources`` are tracked (the least recently active is forgotten); history searches
read at most one entry per entry read live beyond ``repair_allowance``.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Generic, TypeVar

import msgspec

from kvbus.envelope import Envelope
from kvbus.logs import LimitedLog, shown
from kvbus.source_state import Held, HeldBytes, SourceState, SourceTable
from kvbus.transports import Position

log = logging.getLogger("kvbus.subscribe")
_limited = LimitedLog(log)

MAX_HELD: Final = 1 << 16
"""Messages held back for one source's gap before the gap is declared lost at once."""
REPAIR_ALLOWANCE: Final = 1 << 16
"""History entries a subscription's gap searches may read before it has read any entry
live; each entry read live allows one more, up to this many saved. So that searching
costs O(1) per message amortized, however many gaps a stream opens and however far
back. A search starts only when it may read a sixteenth of this (4,096) at least: a
backend fetches a page of history per round trip however few entries are wanted from
it, so under a flood of gaps there is at most one search per 4,096 entries read live."""


class ResyncReason(str, enum.Enum):
    NEW_EPOCH = "new_epoch"
    """The source restarted: everything known about it is obsolete."""
    GAP = "gap"
    """Seqs were lost in transit and the transport's history no longer has them."""
    DROPPED = "dropped"
    """The publisher announced that it dropped these seqs (queue full, backend down)."""
    JOINED = "joined"
    """The first message seen from this source is not the start of its epoch."""
    MALFORMED = "malformed"
    """A message of this source could not be decoded: its effect is lost."""


class Resync(msgspec.Struct, frozen=True, gc=False):
    """Control message: reset your state for ``source``; what follows is ``epoch``."""

    source: str
    epoch: int
    reason: ResyncReason
    lost: tuple[int, int] | None = None
    """Inclusive range of seqs of ``epoch`` that will never be delivered."""
    previous_epoch: int | None = None


class SubscriptionStats(msgspec.Struct):
    delivered: int = 0
    resyncs: int = 0
    resyncs_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    duplicates: int = 0
    """Copies dropped, including live copies of messages already repaired from history."""
    stale: int = 0
    """Messages of an epoch older than the newest seen for their source."""
    gaps_repaired: int = 0
    gaps_lost: int = 0
    malformed: int = 0
    oversized: int = 0
    future_version: int = 0
    unknown_kind: int = 0
    skipped_events: int = 0
    """Events inside otherwise good KV batches whose type is unknown or malformed
    (counted when the batch is decoded: when its ``Message.body`` is first read)."""
    implausible: int = 0
    """Envelopes rejected for an epoch ahead of the clock or an unreachable seq."""
    forged: int = 0
    """Envelopes that claim a source other than the one the transport authenticated."""
    evicted_sources: int = 0
    """Sources forgotten because more than ``max_sources`` were tracked."""
    gaps_declared_early: int = 0
    """Gaps declared lost before ``gap_timeout`` because what was held back for them
    exceeded a limit: 65,536 messages for one source, or ``max_held_bytes`` in all."""
    repair_entries: int = 0
    """History entries read searching for missing seqs."""
    repairs_limited: int = 0
    """History searches cut short or skipped because the subscription had read as many
    history entries as it may (one per entry read live, beyond 65,536)."""
    snapshot_reads: int = 0
    """Times the stored snapshots were read (``snapshot=True``)."""
    snapshots: int = 0
    """Snapshots delivered (``snapshot=True``)."""
    transport_errors: int = 0


class Outcome(enum.Enum):
    """What ``open_message`` answers for a message that is not delivered as such."""

    SKIP = "skip"
    """A kind this kvbus does not know (a newer publisher's): its seq passes silently."""
    MALFORMED = "malformed"
    """Its payload does not decode: its effect is lost, a Resync says so."""
    LOSS_NOTICE = "loss_notice"
    """A `kvbus.events.LossNotice`: its seq is announced lost with the others dropped."""


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


MessageT = TypeVar("MessageT")
Ready = deque[tuple["MessageT | Resync", int | None, Position | None]]


class Sequencer(Generic[MessageT]):
    """Per-source ordering, gap bookkeeping and loss announcement (see the module)."""

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
        self.open_message = open_message
        """The message to deliver for an envelope whose turn it is, or an `Outcome`."""
        self.stats = stats
        self.gap_timeout = gap_timeout
        self.max_held_bytes = max_held_bytes
        self.max_held = max_held
        self.repair_allowance = repair_allowance
        self.on_forget = on_forget
        """Told the name of each source forgotten (``max_sources``)."""
        self.stream = stream
        """For the logs only."""
        self._limited = limited_log
        self.ready: Ready[MessageT] = deque()
        self.held_bytes = HeldBytes()
        self.sources = SourceTable(max_sources, self.held_bytes)
        self.states = self.sources.states
        """The sources tracked, by name."""
        # Sources waiting for missing seqs, in the order their gaps opened: that of
        # their deadlines (each is gap_timeout after the opening).
        self.gapped: OrderedDict[SourceState, None] = OrderedDict()
        self.repair_due: set[SourceState] = set()  # new gaps not yet searched for
        self.repair_credit = repair_allowance  # history entries a search may read

    # --- input -------------------------------------------------------------------------

    def receive(
        self,
        envelope: Envelope,
        position: Position,
        order: int,
        previous: Position | None,
        now: float,
    ) -> None:
        """A checked envelope read live (the ``order``-th entry, after ``previous``)."""
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
            old_epoch = state.epoch
            state.epoch, state.seq, state.position = envelope.epoch, 0, previous
            state.anchor = (order - 1, previous)
            state.drop_held()
            self._close_gap(state)
            self._resync(state, ResyncReason.NEW_EPOCH, 0, old_epoch)
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
            self._declare_early(state, f"{len(state.held)} messages held back")
        elif state.gap_deadline is None:
            state.gap_deadline = now + self.gap_timeout
            self.gapped[state] = None
            self.repair_due.add(state)
        if self.held_bytes.total > self.max_held_bytes:
            self._shed_held()

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

    def read_live(self, entries: int) -> None:
        """``entries`` more were read live: each lets history searches read one more."""
        self.repair_credit = min(self.repair_allowance, self.repair_credit + entries)

    def track(
        self, name: str, epoch: int, seq: int, position: Position | None, order: int
    ) -> SourceState:
        """A new source's state, tracked (at ``seq``, as from a cursor or a snapshot); at
        most ``max_sources`` are."""
        if self.sources.full():
            self._evict_source()
        return self.sources.track(name, epoch, seq, position, order)

    def start_at(
        self, name: str, epoch: int, seq: int, position: Position | None, message: MessageT
    ) -> None:
        """Begin ``name`` at its snapshot (seq ``seq``), delivered as ``message``."""
        self.track(name, epoch, seq, position, -1)
        self.stats.snapshots += 1
        self.ready.append((message, None, None))

    # --- gaps and their deadlines ------------------------------------------------------

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

    def held_messages(self) -> int:
        return sum(len(s.held) for s in self.gapped)

    def held_arrivals(self) -> Iterator[tuple[int, Position | None]]:
        """(arrival order, previous position) of every message held back from the live read."""
        for state in self.states.values():
            for held in state.held.values():
                if held.order is not None:
                    yield held.order, held.previous

    def declare_lost(self, state: SourceState) -> None:
        """Give up on the seqs missing before the held messages: Resync, then deliver."""
        self._close_gap(state)
        while state.held:
            reason = ResyncReason.JOINED if state.seq == 0 else ResyncReason.GAP
            self._resync(state, reason, state.lowest() - 1)
            self._release(state)

    def snapshot_covers(self, state: SourceState, source: str, epoch: int, seq: int) -> bool:
        """Whether a snapshot of ``source`` at ``epoch``/``seq`` covers ``state``'s gap."""
        return (
            source == state.name
            and epoch == state.epoch
            and bool(state.held)
            and state.seq < state.lowest() - 1 <= seq
        )

    def substitute(
        self, state: SourceState, seq: int, position: Position | None, message: MessageT
    ) -> None:
        """Close ``state``'s gap with a snapshot at ``seq``: Resync with nothing lost,
        the snapshot's ``message``, then what follows it."""
        self._close_gap(state)
        reason = ResyncReason.JOINED if state.seq == 0 else ResyncReason.GAP
        self.ready.append((Resync(state.name, state.epoch, reason), None, None))
        self.stats.resyncs += 1
        state.seq, state.position = seq, position
        state.drop_held_through(seq)
        self.stats.snapshots += 1
        self.ready.append((message, None, None))
        self._release(state)

    # --- history searches --------------------------------------------------------------

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
        """An entry ``search`` read (its envelope if checked, else None); False: stop."""
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

    def history_searched(self, search: HistorySearch) -> None:
        """``search`` ended (or failed): deliver what it found."""
        self.repair_credit -= search.read
        self.stats.repair_entries += search.read
        for state in search.wanted.values():
            self._release(state)
        if self.held_bytes.total > self.max_held_bytes:
            self._shed_held()

    # --- delivery ----------------------------------------------------------------------

    def _release(self, state: SourceState) -> None:
        """Deliver held messages that are next in seq order (or whose gap is announced)."""
        repaired = state.gap_deadline is not None
        while state.held:
            held = state.take_next()
            if held is None:
                lowest = state.lowest()
                lost_from = state.held[lowest].envelope.lost_from
                if not lost_from or lost_from > state.seq + 1:
                    return
                self._resync(state, ResyncReason.DROPPED, lowest - 1)
                repaired = False
                continue
            self._deliver(state, held)
        if state.gap_deadline is not None:
            self._close_gap(state)
            if repaired:
                self.stats.gaps_repaired += 1

    def _deliver(self, state: SourceState, held: Held) -> None:
        envelope = held.envelope
        state.position = held.position
        if held.order is not None:
            state.anchor = (held.order, held.position)
        message = self.open_message(envelope, held.position)
        if message is Outcome.SKIP:
            state.seq = envelope.seq
        elif message is Outcome.MALFORMED:  # its effect on the consumer's state is lost
            self._resync(state, ResyncReason.MALFORMED, envelope.seq)
        elif message is Outcome.LOSS_NOTICE:
            self._dropped_through(state, envelope.seq)
        else:
            state.seq = envelope.seq
            self.stats.delivered += 1
            self.ready.append((message, held.order, held.previous))

    def _dropped_through(self, state: SourceState, seq: int) -> None:
        """A `LossNotice` at ``seq``: it takes the seq of the last message its publisher
        dropped, whose payload is lost like the others', so ``seq`` is announced lost
        with them (one Resync: the others' was just queued, if its gap marker had any)
        rather than delivered. Else a lone trailing drop would reach the consumer as a
        control message and no Resync, and its state would silently miss a batch."""
        ready = self.ready
        last = ready[-1][0] if ready else None
        if (
            isinstance(last, Resync)
            and last.source == state.name
            and last.epoch == state.epoch
            and last.reason is ResyncReason.DROPPED
            and last.lost is not None
            and last.lost[1] == seq - 1 == state.seq
        ):
            ready[-1] = (msgspec.structs.replace(last, lost=(last.lost[0], seq)), None, None)
            state.seq = seq
        else:
            self._resync(state, ResyncReason.DROPPED, seq)

    def _resync(
        self,
        state: SourceState,
        reason: ResyncReason,
        lost_to: int,
        previous_epoch: int | None = None,
    ) -> None:
        """Queue a Resync; seqs state.seq+1..lost_to (if any) are declared lost."""
        lost = (state.seq + 1, lost_to) if lost_to > state.seq else None
        if lost is not None:
            state.seq = lost_to
            self.stats.gaps_lost += 1
        self.stats.resyncs += 1
        by_reason = self.stats.resyncs_by_reason
        by_reason[reason.value] = by_reason.get(reason.value, 0) + 1
        if reason is ResyncReason.JOINED:
            # The normal start of a read that does not begin at a source's first
            # message (a cursor, trimmed history, the metrics stream's recent past):
            # nothing went missing, so it is no news at INFO.
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "kvbus: %s in %s: joined at seq %d of epoch %s",
                    shown(state.name),
                    self.stream,
                    state.seq + 1,
                    state.epoch,
                )
        else:
            self._limited.info(
                f"resync_{reason.value}",
                "kvbus: resync %s in %s epoch %s: %s%s",
                shown(state.name),
                self.stream,
                state.epoch,
                reason.value,
                f", seqs {lost[0]}-{lost[1]} lost" if lost else "",
            )
        self.ready.append(
            (Resync(state.name, state.epoch, reason, lost, previous_epoch), None, None)
        )

    # --- the caps ----------------------------------------------------------------------

    def _close_gap(self, state: SourceState) -> None:
        state.gap_deadline = None
        self.gapped.pop(state, None)
        self.repair_due.discard(state)

    def _shed_held(self) -> None:
        """Declare the oldest gaps lost (their deadlines are the nearest) until what is
        held back for gaps fits in ``max_held_bytes`` again."""
        while self.held_bytes.total > self.max_held_bytes and self.gapped:
            self._declare_early(
                next(iter(self.gapped)),
                f"{self.held_bytes.total} bytes held back for all gaps "
                f"(max_held_bytes={self.max_held_bytes})",
            )

    def _declare_early(self, state: SourceState, why: str) -> None:
        """Declare ``state``'s gap lost before its deadline: too much is held for it."""
        self.stats.gaps_declared_early += 1
        self._limited.warning(
            "declared_early",
            "kvbus: declared the gap of %s in %s lost before gap_timeout: %s",
            shown(state.name),
            self.stream,
            why,
        )
        self.declare_lost(state)

    def _evict_source(self) -> None:
        """Forget the least recently active source (`SourceTable.idlest`). One holding
        messages back has its gap declared lost first, so that nothing it held goes
        unannounced. A source that comes back starts over with a JOINED resync."""
        state = self.sources.idlest()
        if state.held:
            self.declare_lost(state)
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


__all__ = [
    "HistorySearch",
    "Outcome",
    "Resync",
    "ResyncReason",
    "Sequencer",
    "SourceState",
    "SubscriptionStats",
]
