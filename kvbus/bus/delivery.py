"""Delivery: what the consumer gets, in which order, and which `Resync` says what is lost.

`Delivery` is the part of `kvbus.bus.sequencer.Sequencer` that turns the messages a source
holds back into the queue of items to hand out (``ready``). It decides, and nothing else
here does:

* **order, at most once**: a message is delivered only as the seq right after the
  source's ``seq`` (the last delivered or declared lost), which it then becomes
  (`Delivery.release`); so each seq is delivered at most once, in increasing order;
* **every loss announced once**: seqs are skipped only by a `Resync` whose ``lost``
  range starts right after ``seq`` and which moves ``seq`` to its end
  (`Delivery.resync`): DROPPED at once for seqs a gap marker or a loss notice
  announces; GAP (JOINED for a source first seen mid-epoch) when a gap is given up
  (`Delivery.declare_lost`: on expiry, or early by `kvbus.bus.hold_limits`); MALFORMED for a
  message that does not decode; NEW_EPOCH when a source restarts (`Delivery.new_epoch`);
* **snapshots**: a gap that a stored snapshot covers is closed by the snapshot, after a
  Resync with nothing lost (`Delivery.substitute`).

The gaps' deadlines and history searches are `kvbus.bus.gap_repair.GapRepair`'s: delivery
closes a gap there when it is filled or announced.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from kvbus.bus.gap_repair import GapRepair
from kvbus.bus.source_state import Held, SourceState
from kvbus.bus.subscription_stats import SubscriptionStats
from kvbus.logs import LimitedLog, shown
from kvbus.transports import Position
from kvbus.wire.envelope import Envelope

log = logging.getLogger("kvbus.bus.subscription")


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


class Outcome(enum.Enum):
    """What ``open_message`` answers for a message that is not delivered as such."""

    SKIP = "skip"
    """A kind this kvbus does not know (a newer publisher's): its seq passes silently."""
    MALFORMED = "malformed"
    """Its payload does not decode: its effect is lost, a Resync says so."""
    LOSS_NOTICE = "loss_notice"
    """A `kvbus.wire.events.LossNotice`: its seq is announced lost with the others dropped."""


MessageT = TypeVar("MessageT")
Ready = deque[tuple["MessageT | Resync", int | None, Position | None]]


class Delivery(Generic[MessageT]):
    """The items to hand out, and the rules that put them there (see the module)."""

    def __init__(
        self,
        open_message: Callable[[Envelope, Position], MessageT | Outcome],
        stats: SubscriptionStats,
        gaps: GapRepair,
        *,
        stream: str,
        limited_log: LimitedLog,
    ) -> None:
        self.open_message = open_message
        """The message to deliver for an envelope whose turn it is, or an `Outcome`."""
        self.stats = stats
        self.gaps = gaps
        self.stream = stream
        self._limited = limited_log
        self.ready: Ready[MessageT] = deque()
        """(item, arrival order of the entry that brought it, position read just before
        that entry), in the order to hand out; None, None for a Resync or a snapshot."""

    def release(self, state: SourceState) -> None:
        """Deliver held messages that are next in seq order (or whose gap is announced);
        a gap left with nothing held is closed (repaired, if nothing was announced)."""
        repaired = state.gap_deadline is not None
        while state.held:
            held = state.take_next()
            if held is None:
                lowest = state.lowest()
                lost_from = state.held[lowest].envelope.lost_from
                if not lost_from or lost_from > state.seq + 1:
                    return
                self.resync(state, ResyncReason.DROPPED, lowest - 1)
                repaired = False
                continue
            self._deliver(state, held)
        if state.gap_deadline is not None:
            self.gaps.close(state)
            if repaired:
                self.stats.gaps_repaired += 1

    def declare_lost(self, state: SourceState) -> None:
        """Give up on the seqs missing before the held messages: Resync, then deliver."""
        self.gaps.close(state)
        while state.held:
            reason = ResyncReason.JOINED if state.seq == 0 else ResyncReason.GAP
            self.resync(state, reason, state.lowest() - 1)
            self.release(state)

    def new_epoch(
        self, state: SourceState, epoch: int, order: int, previous: Position | None
    ) -> None:
        """``state``'s source restarted at ``epoch`` (seen at the ``order``-th entry):
        what it held back is obsolete, and a NEW_EPOCH Resync says so."""
        old_epoch = state.epoch
        state.epoch, state.seq, state.position = epoch, 0, previous
        state.anchor = (order - 1, previous)
        state.drop_held()
        self.gaps.close(state)
        self.resync(state, ResyncReason.NEW_EPOCH, 0, old_epoch)

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
        self.gaps.close(state)
        reason = ResyncReason.JOINED if state.seq == 0 else ResyncReason.GAP
        self.ready.append((Resync(state.name, state.epoch, reason), None, None))
        self.stats.resyncs += 1
        state.seq, state.position = seq, position
        state.drop_held_through(seq)
        self.stats.snapshots += 1
        self.ready.append((message, None, None))
        self.release(state)

    def _deliver(self, state: SourceState, held: Held) -> None:
        envelope = held.envelope
        state.position = held.position
        if held.order is not None:
            state.anchor = (held.order, held.position)
        message = self.open_message(envelope, held.position)
        if message is Outcome.SKIP:
            state.seq = envelope.seq
        elif message is Outcome.MALFORMED:  # its effect on the consumer's state is lost
            self.resync(state, ResyncReason.MALFORMED, envelope.seq)
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
            self.resync(state, ResyncReason.DROPPED, seq)

    def resync(
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


__all__ = ["Delivery", "Outcome", "Ready", "Resync", "ResyncReason"]
